"""Per-request sampling parameters, with vLLM's names and defaults."""
from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# The sampler works in float32: a factor whose reciprocal overflows float32 (1 / 1e-39) turns logits into inf
# and the whole distribution into NaN, so such values are rejected here, by name.
_F32_MAX = 3.4028234663852886e38
_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 64 - 1  # what torch.Generator.manual_seed accepts
LOGIT_BIAS_MAX = 100.0  # OpenAI's range for logit_bias values: [-100, 100]


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_text(value: str, what: str) -> None:
    """A lone UTF-16 surrogate (JSON's "\\ud800") is not text: no tokenizer can encode it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} contains an invalid Unicode code point (a lone surrogate); send valid UTF-8 text.") \
            from None


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token: its logprob and the top-N (the first token has none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema / regex / choice / grammar
    min_tokens: int = 0  # before this many output tokens, EOS, stop_token_ids and stop strings do not end it
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI)
    # The expected output, or most of it (OpenAI's Predicted Outputs): the lookup sources draft from it first.
    # Only where speculation drafts by lookup (the default, ngram, suffix); it never changes the output.
    prediction: str | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as max_model_len leaves room for, with one to write)
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be generated
    # vLLM's: words that must not be generated; the last token of a word is refused where it would complete it
    bad_words: list[str] | None = None
    # False: this request drafts nothing (plain decoding by the same target, so greedy output is the same); the
    # engine's speculative method keeps serving the others. To compare speeds on one server.
    speculative_decoding: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k in (0, None):
            self.top_k = -1
        self._validate()
        self.logit_bias = _logit_bias(self.logit_bias)

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"Invalid SamplingParams: {msg}")

        def real(name: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> float:
            v = getattr(self, name)
            if not _is_real(v):
                bad(f"{name} must be a finite number, got {v!r}.")
            if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
                if hi is None:
                    bad(f"{name} must be {'>' if lo_open else '>='} {lo:g}, got {v!r}.")
                bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}.")
            return v

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}.")
        if self.temperature is None:
            bad("temperature must be a number >= 0 (0 means greedy), got None.")
        real("temperature", 0.0)  # below _GREEDY_EPS it is greedy, so 1 / temperature stays small
        real("top_p", 0.0, 1.0, lo_open=True)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k != -1):
            bad(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}.")
        real("min_p", 0.0, 1.0)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1 (or None for 'up to max_model_len'), got {self.max_tokens!r}.")
        real("presence_penalty", -2.0, 2.0)
        real("frequency_penalty", -2.0, 2.0)
        rp = real("repetition_penalty", 0.0, lo_open=True)
        if rp > _F32_MAX or 1.0 / rp > _F32_MAX:
            bad(f"repetition_penalty {rp!r} is out of range: it and its reciprocal must be finite in float32.")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not _SEED_MIN <= self.seed <= _SEED_MAX):
            bad(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}.")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 20):
                bad(f"{name} must be between 0 and 20, got {v!r}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a string or a list of non-empty strings.")
        for s in self.stop:
            check_text(s, "stop")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be a list of non-negative integers.")
        if (not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0):
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}.")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, (list, tuple)) or not allowed or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in allowed)):
            bad("allowed_token_ids must be a non-empty list of token ids (integers >= 0).")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or any(
                    not isinstance(w, str) or not w.strip() for w in self.bad_words):
                bad("bad_words must be a list of words (non-empty strings).")
            for w in self.bad_words:
                check_text(w, "bad_words")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or (t < 1 and t != -1)):
            bad(f"truncate_prompt_tokens must be -1 (to max_model_len) or an integer >= 1, got {t!r}.")
        if self.prediction is not None:
            if not isinstance(self.prediction, str):
                bad(f"prediction must be a string (the expected output), got {type(self.prediction).__name__}.")
            check_text(self.prediction, "prediction")
        if not isinstance(self.speculative_decoding, bool):
            bad(f"speculative_decoding must be true or false, got {self.speculative_decoding!r}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs must be a StructuredOutputsParams (from specdecode.sampling_params import "
                f"StructuredOutputsParams), got {type(self.structured_outputs).__name__}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes) -> "SamplingParams":
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(changes)
        return SamplingParams(**d)


def _logit_bias(bias: object) -> dict[int, float] | None:
    """logit_bias as {token id: bias}: integer ids (or their decimal strings, JSON's object keys), finite
    biases within [-100, 100]. Whether each id is in the vocabulary is checked where the vocabulary is known."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"Invalid SamplingParams: logit_bias must be a dict of token id -> bias, got "
                         f"{type(bias).__name__}.")
    out: dict[int, float] = {}
    for k, v in bias.items():
        key = k
        if isinstance(k, str) and k.strip().lstrip("+").isdigit():
            key = int(k)
        if not isinstance(key, int) or isinstance(key, bool) or key < 0:
            raise ValueError(f"Invalid SamplingParams: logit_bias keys must be token ids (integers >= 0), "
                             f"got {k!r}.")
        if not _is_real(v) or abs(v) > LOGIT_BIAS_MAX:
            raise ValueError(f"Invalid SamplingParams: logit_bias values must be finite numbers in [-100, 100], "
                             f"got {v!r} for token {key}.")
        out[key] = float(v)
    return out or None
