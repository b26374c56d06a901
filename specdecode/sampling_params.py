"""Per-request sampling parameters, with vLLM's names and defaults."""
from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k in (0, None):
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"Invalid SamplingParams: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}.")
        if self.temperature is None or self.temperature < 0:
            bad(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}.")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}; use 1.0 to disable it.")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}.")
        if not (0.0 <= self.min_p <= 1.0):
            bad(f"min_p must be in [0, 1], got {self.min_p!r}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1 (or None for 'up to max_model_len'), got {self.max_tokens!r}.")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}.")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}.")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}.")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad(f"logprobs must be between 0 and 20, got {self.logprobs!r}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a string or a list of non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be a list of non-negative integers.")

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
