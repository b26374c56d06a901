"""What generate() returns, in vLLM's shape."""
from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.speculative.metrics import SpecDecodeStats


@dataclass
class Logprob:
    """vLLM's Logprob: a token's log probability, its rank in the vocabulary (1: the most likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: the chosen token's Logprob and those of the top-N tokens (vLLM's SampleLogprobs); for a prompt,
# the first position has none (vLLM's PromptLogprobs).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list["dict[int, Logprob] | None"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # With SamplingParams.prediction, once finished: its tokens that appear in the output and the rest (OpenAI's)
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the request failed (finish_reason "error"); it failed alone
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams.prompt_logprobs
