"""Prompt lookup by text rather than by token ids.

A value copied from the prompt is often split into other tokens than the prompt's: inside a JSON string it starts
right after the quote, so the prompt's ` Denmark` comes out as `Den` + `mark`. A lookup keyed on token ids finds
neither token in the prompt. This one finds the output's last characters in the prompt's text and drafts the
tokens of the phrase that follows them there. The drafts are one-hot and cost no model pass; the verifier keeps
whatever the target agrees with, so a wrong guess costs only the rows it adds.
"""
from __future__ import annotations

import functools
import weakref

# Where a copied value most likely ends: the prompt's phrase goes on, the value does not.
PHRASE_END = frozenset('",.;:!?()[]{}<>\n')
# Texts that close a quoted value, and texts that close the arrays and objects around a value just closed, in
# the order they are tried: the tokenizer's single tokens for them.
_STRING_CLOSERS = ('",', '"],', '"},', '"]}', '"]', '"}', '"')
_BRACKET_CLOSERS = (']}', '}]', ']]', '}}', ']', '}')


class TextLookup:
    def __init__(self, tokenizer, min_chars: int = 3, unanchored_chars: int = 16, max_chars: int = 32,
                 max_tokens: int = 4):
        self.tokenizer = tokenizer
        # A match must reach back to the quote that opened the value being written (`"Den` copies a word), or be
        # long: in prose, a few characters match the prompt everywhere without the output copying it.
        self.min_chars = min_chars
        self.unanchored_chars = unanchored_chars
        self.max_chars = max_chars
        self.max_tokens = max_tokens  # each draft adds a verification row, and a copied phrase is short
        self._prompts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def propose(self, request, prefix: list[int], budget: int) -> list[int] | None:
        """Up to ``budget`` tokens of the prompt's phrase that the request's output (followed by ``prefix``:
        tokens drafted before these, not yet committed) is copying: the prompt's text after the longest match
        of the output's last characters, up to the phrase's end (``PHRASE_END``, spaces before it dropped). An
        empty list where the match ends the phrase; None without a match of ``min_chars`` characters that
        begins a quoted value, or of ``unanchored_chars``."""
        tail = request.text[-self.max_chars:]
        if prefix:
            tail = (tail + self.tokenizer.decode(prefix))[-self.max_chars:]
        source = self._prompt_text(request)
        # A suffix of the tail that is not in the prompt has no longer suffix that is: grow from the shortest.
        start, n = -1, self.min_chars
        while n <= len(tail):
            found = source.find(tail[-n:])
            if found < 0:
                break
            start, n = found + n, n + 1
        n -= 1  # the longest match's length
        if start < 0 or (n < self.unanchored_chars and tail[-n - 1:-n] != '"' and tail[-n] != '"'):
            return None
        end = start
        while end < len(source) and end - start < 8 * self.max_tokens and source[end] not in PHRASE_END:
            end += 1
        cut = end < len(source) and source[end] not in PHRASE_END
        phrase = source[start:end] if cut else source[start:end].rstrip()  # a value does not end in a space
        if not phrase:
            return []
        tokens = self.tokenizer.encode(phrase, add_special_tokens=False)
        if cut and len(tokens) > 1:
            tokens = tokens[:-1]  # cut inside a word: its last token is not the prompt's split
        return tokens[:max(0, min(budget, self.max_tokens))]

    @functools.cached_property
    def string_closers(self) -> list[int]:
        """Single tokens that end a quoted value (``"``, ``",``, ``"]``, ...), most common first."""
        return self._single_tokens(_STRING_CLOSERS)

    @functools.cached_property
    def bracket_closers(self) -> list[int]:
        """Single tokens that close arrays and objects (``]}``, ``]``, ``}``, ...), most common first."""
        return self._single_tokens(_BRACKET_CLOSERS)

    def _single_tokens(self, texts: tuple[str, ...]) -> list[int]:
        out = []
        for text in texts:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == 1 and ids[0] not in out:
                out.append(ids[0])
        return out

    def _prompt_text(self, request) -> str:
        text = self._prompts.get(request)
        if text is None:
            text = request.prompt if isinstance(request.prompt, str) else self.tokenizer.decode(
                request.prompt_token_ids)
            self._prompts[request] = text
        return text
