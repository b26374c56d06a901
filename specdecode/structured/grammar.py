"""Grammar constraints on the xgrammar engine: compiled once per constraint (LRU), matched per request.

xgrammar was picked over llguidance by its per-token mask cost on the default pair's 152k-token vocabulary
(see the README); both are maintained and both roll back, which speculation needs."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from specdecode.speculative.text_lookup import TextLookup
from specdecode.structured.params import StructuredOutputsParams

# The longest run of whitespace JSON output may have between two elements. JSON allows any amount, and under a
# mask that leaves little else a model can fall into a loop of newlines; the cap ends such loops while leaving
# room for pretty-printing a few levels deep.
MAX_JSON_WHITESPACE = 20

_INFO_CACHE: "OrderedDict[tuple, object]" = OrderedDict()
_INFO_LOCK = threading.Lock()


def _tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
    """xgrammar's view of a tokenizer (a few seconds for a 152k vocabulary), shared by engines whose tokenizer
    has the same vocabulary and stop tokens."""
    import xgrammar as xgr

    vocab = tokenizer.get_vocab()
    key = (vocab_size, tuple(sorted(stop_token_ids)), len(vocab), hash(frozenset(vocab.items())))
    with _INFO_LOCK:
        info = _INFO_CACHE.get(key)
        if info is None:
            from specdecode.tokenizer import hf_tokenizer

            info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer(tokenizer), vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_token_ids))
            _INFO_CACHE[key] = info
            while len(_INFO_CACHE) > 4:
                _INFO_CACHE.popitem(last=False)
        return info


def _choice_grammar(choices: list[str]) -> str:
    # JSON string syntax is also the EBNF's string-literal syntax (backslash escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Spellings:
    """How the model splits text that grammars force, learned from its own choices.

    The engine drafts forced text as the tokenizer splits it on its own. The model may split the same text
    otherwise (``answer`` + ``s`` where the tokenizer has ``answers``), and then rejects the forced token where
    the two part, and every draft after it in that step. Where that happened, the token the model chose is kept
    for the text that remained (``learn``); the next time that text is forced it is split that way (``split``).
    One engine's requests share it: requests under one schema are forced the same keys again and again. Any
    split is exact: forced drafts are a function of the committed state and this table, never of the step's
    random draws, and the verifier checks them like any draft."""

    def __init__(self, tokenizer, size: int = 4096):
        self._tokenizer = tokenizer
        self._first: "OrderedDict[str, int]" = OrderedDict()  # text -> the model's first token of it
        self._size = size
        self._lock = threading.Lock()
        # The stop token the model ended its last constrained output with: where a grammar allows only stop
        # tokens (chat models have two, `<|im_end|>` and `<|endoftext|>`), that one is drafted.
        self.stop: int | None = None

    def _piece(self, token: int) -> str:
        return self._tokenizer.decode([token])

    def split(self, text: str) -> list[int]:
        """Tokens for ``text``: the tokenizer's split, except where a learned first token applies to the
        text that remains at a token boundary."""
        encode = self._tokenizer.encode
        if not self._first:
            return encode(text, add_special_tokens=False)
        out: list[int] = []
        pos = 0
        with self._lock:
            while pos < len(text):
                learned = self._first.get(text[pos:])
                if learned is not None:
                    out.append(learned)
                    pos += len(self._piece(learned))
                    continue
                for t in encode(text[pos:], add_special_tokens=False):
                    out.append(t)
                    pos += len(self._piece(t))
                    if text[pos:] in self._first:
                        break
                else:
                    break
        # A token that is part of a character decodes to a replacement mark: then the positions are off.
        return out if self._tokenizer.decode(out) == text else encode(text, add_special_tokens=False)

    def learn(self, text: str, drafted: Sequence[int], at: int, chosen: int) -> None:
        """``text`` was forced and drafted as ``drafted``; the verifier rejected drafted[at] and the model
        chose ``chosen`` instead. Keep ``chosen`` as the first token of the text that remained, if it spells a
        start of that text, and the rejected token was not the text's last: a token that runs on into free
        text says nothing about the forced part, and at the last one the model's split follows the free text
        after it (`` `` then ``[{`` where ``[{"`` came next), which another answer need not share."""
        done = len(self._tokenizer.decode(list(drafted[:at])))
        rest, piece = text[done:], self._piece(chosen)
        if not piece or not rest.startswith(piece) or done + len(self._piece(drafted[at])) >= len(text):
            return
        with self._lock:
            self._first[rest] = chosen
            self._first.move_to_end(rest)
            while len(self._first) > self._size:
                self._first.popitem(last=False)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer; keeps the last ``cache_size`` compiled grammars.

    Compiling a JSON schema walks the whole vocabulary (tens to hundreds of ms), so requests that share a
    constraint share its compiled form; matchers (per request state) are cheap."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], cache_size: int = 128):
        import xgrammar as xgr

        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.info = _tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._cache: "OrderedDict[tuple, object]" = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # Per engine, shared by its requests: how the model splits forced text, and where outputs copy their prompts.
        self.spellings = Spellings(tokenizer)
        self.text_lookup = TextLookup(tokenizer)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar for params; a ValueError carrying xgrammar's message if it does not compile."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        kind, text, compact = key
        c = self._compiler
        try:
            if kind == "json":
                compiled = c.compile_json_schema(text, any_whitespace=not compact, strict_mode=True,
                                                 max_whitespace_cnt=None if compact else MAX_JSON_WHITESPACE)
            elif kind == "json_object":
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=not compact,
                                                 max_whitespace_cnt=None if compact else MAX_JSON_WHITESPACE)
            elif kind == "regex":
                compiled = c.compile_regex(text)
            elif kind == "choice":
                compiled = c.compile_grammar(_choice_grammar(params.choice))
            else:
                compiled = c.compile_grammar(text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types for bad input
            msg = str(e).strip().splitlines()
            raise ValueError(f"Invalid {kind} constraint: {msg[0] if msg else type(e).__name__}"
                             + (f" {' '.join(m.strip() for m in msg[1:3])}" if len(msg) > 1 else "")) from None
        if not Matcher(compiled, self.vocab_size, self.tokenizer, self.spellings).allowed()[0].any():
            # e.g. the regex [^\s\S] or a schema that only refers to itself: every request would fail at its
            # first token, so the constraint is the caller's error.
            raise ValueError(f"Invalid {kind} constraint: no text satisfies it (it allows no first token).")
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, params: StructuredOutputsParams) -> "Matcher":
        return Matcher(self.compile(params), self.vocab_size, self.tokenizer, self.spellings)


class Matcher:
    """One request's position in its grammar. ``advance`` commits tokens; the speculative helpers
    (``allowed``, ``valid_prefix``, ``forced``) look ahead and always return with the state unchanged."""

    def __init__(self, compiled, vocab_size: int, tokenizer, spellings: Spellings | None = None):
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        # Special tokens other than the stop tokens never match a grammar; xgrammar logs a warning for each
        # one offered, and drafters do offer them, so they are refused here without asking.
        self._refused = frozenset(compiled.tokenizer_info.special_token_ids) - frozenset(self._m.stop_token_ids)
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._tokenizer = tokenizer
        self.spellings = spellings if spellings is not None else Spellings(tokenizer)
        self.forced_text = ""  # the text the last forced() call split

    def is_terminated(self) -> bool:
        """The grammar has accepted a stop token: nothing may follow."""
        return self._m.is_terminated()

    def advance(self, tokens: Sequence[int]) -> bool:
        """Commit tokens; False (and the state left after the last accepted one) at the first illegal one."""
        for t in tokens:
            if not self._accept(int(t)):
                return False
        return True

    def _accept(self, t: int) -> bool:
        return t not in self._refused and 0 <= t < self.vocab_size and self._m.accept_token(t)

    def rollback(self, n: int) -> None:
        """Undo the last n committed tokens."""
        if n > 0:
            self._m.rollback(n)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the grammar accepts from the current state."""
        n = 0
        try:
            for t in tokens:
                if self._m.is_terminated() or not self._accept(int(t)):
                    break
                n += 1
        finally:
            self.rollback(n)
        return n

    def allowed(self, prefix: Sequence[int] = ()) -> torch.Tensor:
        """[len(prefix) + 1, vocab_size] bool: row j is the tokens allowed after prefix[:j], from the current
        state (the rows a verification pass over the drafts ``prefix`` needs). Rows that no accepted draft can
        reach (after a token the grammar forbids, or after its stop token) allow everything: they are never
        sampled from, and must stay finite distributions."""
        rows = len(prefix) + 1
        bits = np.full((rows, self._words), -1, dtype=np.int32)
        n = 0
        try:
            for j in range(rows):
                if self._m.is_terminated():
                    break
                self._m.fill_next_token_bitmask(bits, j)
                if j == len(prefix) or not self._accept(int(prefix[j])):
                    break
                n += 1
        finally:
            self.rollback(n)
        mask = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab_size]
        return torch.from_numpy(mask.view(np.bool_))

    def _only_stop(self) -> int | None:
        """Where the grammar has ended and allows nothing but a stop token: the one to draft (the model's
        last choice, ``Spellings.stop``, where allowed). None elsewhere; checked by offering a stop token
        first, which fails at once wherever text may still follow."""
        stops = list(self._m.stop_token_ids)
        if not stops or not self.valid_prefix(stops[:1]):
            return None
        allowed = set(torch.nonzero(self.allowed()[0]).flatten().tolist())
        if not allowed <= set(stops):
            return None
        return self.spellings.stop if self.spellings.stop in allowed else stops[0]

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens of the text the grammar forces next (its only legal continuation), split as
        the model was seen to split it (``Spellings``); where the grammar has ended, its stop token; empty when
        the next text is not determined."""
        if limit <= 0 or self._m.is_terminated():
            return []
        text = self.forced_text = self._m.find_jump_forward_string()
        if not text:
            stop = self._only_stop()
            return [stop] if stop is not None else []
        ids = self.spellings.split(text)[:limit]
        # A standalone split may differ from one the grammar allows; keep the part it accepts.
        return ids[:self.valid_prefix(ids)]
