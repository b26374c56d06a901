"""A request's inputs checked and turned into token ids: the prompt (text, ids, or the prefix of a
fill-in-the-middle prompt), its predicted output, its bad words, and the sampling parameters that name token
ids. Everything here runs before a request is queued, so a bad input is the caller's error, not a failed
request; tokenizing may run off the engine thread (the async engine does so)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from specdecode.config import SpeculativeConfig
from specdecode.fim import FimTokens, find_fim_tokens, fim_prompt_ids, known_spellings
from specdecode.sampling_params import SamplingParams, check_text
from specdecode.speculative.proposer import Proposer
from specdecode.tokenizer import encode_text


@dataclass
class ProcessedInput:
    """What a request feeds the engine, its params aside."""
    prompt_token_ids: list[int]
    max_tokens: int                      # params.max_tokens within what the context leaves after the prompt
    prediction_ids: list[int] | None     # SamplingParams.prediction's tokens
    bad_words_ids: list[list[int]]       # SamplingParams.bad_words as token sequences


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int, eos_token_ids: set[int],
                 speculation: Callable[[], tuple[Proposer | None, SpeculativeConfig | None]]):
        """``speculation``: the engine's current proposer and its config (they change with set_speculative),
        which decide whether a request may bring a prediction."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._speculation = speculation

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """More characters than any prompt of max_model_len tokens can have (twice the longest vocabulary
        entry per token, which also covers normalizers that shorten text)."""
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        return 2 * self.max_model_len * max(longest, 1)

    def _cannot_fit(self, text: str) -> bool:
        """Whether ``text`` has more characters than max_model_len tokens can hold, told without tokenizing it
        (tokenizing megabytes only to say so would stall the caller). The bound is at least 2 * max_model_len,
        and shorter text skips it: finding the vocabulary's longest entry reads the whole vocabulary (a large
        one takes a noticeable moment), which would otherwise delay a first answer."""
        return len(text) > 2 * self.max_model_len and len(text) > self.max_prompt_chars

    @functools.cached_property
    def fim_tokens(self) -> FimTokens | None:
        """The target's fill-in-the-middle tokens (specdecode.fim), None if its vocabulary has none."""
        return find_fim_tokens(self.tokenizer)

    def process(self, prompt: str | list[int] | None, params: SamplingParams,
                prompt_token_ids: list[int] | None = None,
                prediction_token_ids: list[int] | None = None) -> ProcessedInput:
        """A request's inputs, checked and encoded. ``prediction_token_ids``: params.prediction already
        tokenized (``encode_prediction``); by default it is tokenized here."""
        self.check_params(params)
        bad_words = self.bad_words_ids(params.bad_words)
        ids = self.encode_prompt(prompt, prompt_token_ids, truncate=params.truncate_prompt_tokens)
        predicted = (self.encode_prediction(params.prediction) if prediction_token_ids is None
                     else self._checked_ids(prediction_token_ids, "prediction token ids"))
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return ProcessedInput(ids, max_tokens, predicted, bad_words)

    def check_params(self, params: SamplingParams) -> None:
        """The checks of sampling parameters that need the vocabulary or the model's end-of-sequence ids."""
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"logit_bias names token id {max(params.logit_bias)}, outside the vocabulary "
                             f"(ids 0..{self.vocab_size - 1}).")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= self.vocab_size:
            raise ValueError(f"allowed_token_ids names token id {max(params.allowed_token_ids)}, outside the "
                             f"vocabulary (ids 0..{self.vocab_size - 1}).")
        if params.allowed_token_ids and params.min_tokens > 0:
            held = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            if set(params.allowed_token_ids) <= held:
                raise ValueError("allowed_token_ids holds only stop tokens, which min_tokens holds back: no token "
                                 "could be written before min_tokens.")

    def encode_prompt(self, prompt: str | list[int] | None, prompt_token_ids: list[int] | None = None,
                      suffix: str | None = None, truncate: int | None = None) -> list[int]:
        """The token ids a prompt feeds the model. With a ``suffix``, the prompt (text or ids) is the prefix of a
        fill-in-the-middle prompt: the model writes what goes between the two. An empty suffix is none (OpenAI's
        completions API reads it so). ``truncate`` (SamplingParams.truncate_prompt_tokens): keep the last
        ``truncate`` ids; -1 keeps as many as leave room for one token to be written."""
        if prompt_token_ids is None and isinstance(prompt, list):
            prompt_token_ids, prompt = prompt, None
        if suffix is not None and not isinstance(suffix, str):
            raise ValueError(f"suffix must be a string, got {type(suffix).__name__}.")
        if truncate is not None:
            if suffix:
                raise ValueError("truncate_prompt_tokens cannot be combined with suffix: cutting the start of a "
                                 "fill-in-the-middle prompt would cut its prefix token.")
            if truncate >= self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens ({truncate}) must be below the context length "
                                 f"({self.max_model_len} tokens), or -1.")
        fim = None
        if suffix:
            fim = self.fim_tokens
            if fim is None:
                raise ValueError("suffix asks to fill in the middle, which needs a code model trained for it: this "
                                 f"model's vocabulary has none of the known tokens for it ({known_spellings()}).")
            check_text(suffix, "suffix")
            if self._cannot_fit(suffix):
                raise ValueError(f"suffix has {len(suffix)} characters, more than {self.max_model_len} tokens "
                                 f"(max_model_len) can hold; shorten it or raise max_model_len.")
        if prompt_token_ids is not None:
            ids = self._checked_ids(prompt_token_ids, "prompt token ids")
        else:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}.")
            check_text(prompt, "prompt")
            if truncate is None and self._cannot_fit(prompt):
                raise ValueError(f"The prompt has {len(prompt)} characters, more than {self.max_model_len} tokens "
                                 f"(max_model_len) can hold; shorten the prompt or raise max_model_len.")
            ids = encode_text(self.tokenizer, prompt) if fim is None else self.tokenizer.encode(
                prompt, add_special_tokens=False)
        if fim is not None:
            ids = fim_prompt_ids(self.tokenizer, fim, ids, suffix)
        if truncate is not None:
            ids = ids[-(self.max_model_len - 1 if truncate == -1 else truncate):]
        if not ids:
            bos = getattr(self.tokenizer, "bos_token_id", None)
            if bos is None:
                raise ValueError("The prompt is empty and the tokenizer has no BOS token to start from.")
            ids = [bos]
        if len(ids) >= self.max_model_len:
            raise ValueError(f"The prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                             "shorten the prompt or raise max_model_len.")
        return ids

    def bad_words_ids(self, words: list[str] | None) -> list[list[int]]:
        """SamplingParams.bad_words as token sequences: each word as written and after a space (a word starts
        with one inside a text, not at its start), as vLLM tokenizes them."""
        seqs: list[list[int]] = []
        for word in words or ():
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def _checked_ids(self, token_ids: list[int], what: str) -> list[int]:
        ids = [int(t) for t in token_ids]
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"{what} must be in [0, {self.vocab_size}).")
        return ids

    def encode_prediction(self, prediction: str | None) -> list[int] | None:
        """The tokens of a request's predicted output (SamplingParams.prediction), which only a speculative
        method that drafts by lookup can use: elsewhere it is refused, not ignored."""
        if not prediction:
            return None
        proposer, spec = self._speculation()
        if proposer is None or not proposer.drafts_by_lookup:
            method = "off" if proposer is None else f"'{spec.method}'"
            raise ValueError(f"prediction needs a speculative method that drafts by lookup (the default, ngram or "
                             f"suffix); speculative decoding here is {method}.")
        if self._cannot_fit(prediction):
            raise ValueError(f"The prediction has {len(prediction)} characters, more than {self.max_model_len} "
                             "tokens (max_model_len) can hold; shorten it.")
        return self.tokenizer.encode(prediction, add_special_tokens=False)
