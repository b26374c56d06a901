"""What generate() returns, in vLLM's shape."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from specdecode.speculative.metrics import SpecDecodeStats

# Where an output token came from (CompletionOutput.token_origins). Drafts the target accepted: "lookup" (prompt
# lookup, the suffix index, a predicted output, a grammar's text lookup), "draft" (the draft model), "grammar"
# (text the request's grammar forces). The target's own token of a step: "bonus" (every draft was accepted),
# "corrected" (it replaces the first rejected draft), "target" (the step drafted nothing: the first token, or
# speculation off).
TokenOrigin = Literal["lookup", "draft", "grammar", "bonus", "corrected", "target"]
TOKEN_ORIGINS: tuple[str, ...] = ("lookup", "draft", "grammar", "bonus", "corrected", "target")
DRAFTED_ORIGINS = frozenset({"lookup", "draft", "grammar"})


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
    # Per token of token_ids: where it came from, and where its text ends in ``text`` (characters; a token
    # whose bytes complete no character yet ends where the one before it does; cut at a stop string)
    token_origins: list[TokenOrigin] = field(default_factory=list)
    token_text_ends: list[int] = field(default_factory=list)


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
