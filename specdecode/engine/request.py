"""Per-request state, owned by the scheduler."""
from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from specdecode.layers.sampler import PositionNoise
from specdecode.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from specdecode.sampling_params import SamplingParams
from specdecode.speculative.state import SpecState
from specdecode.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from specdecode.structured.grammar import Matcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer, max_tokens: int, index: int = 0):
        self.request_id = request_id
        self.index = index  # which of the parent's n samples this is
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # set when this request failed alone (finish_reason "error")
        self.slot: int | None = None
        # KV lengths: how many leading tokens of all_token_ids each cache holds. The target always holds
        # all but the newest token, which is fed at the next step.
        self.num_computed = 0
        self.draft_computed = 0
        self.draft_prefix: list[int] = []  # this step's tokens the engine drafts before the proposer's
        self.num_forced = 0  # output tokens that were forced text of its grammar (drafted by the engine)
        self.forced_text = ""  # the text this step's forced drafts spell (with a grammar)
        self.text_drafted = False  # this step's drafts after the forced ones came from a TextLookup
        # Prefill computes positions [num_computed, prefill_end): the prompt, or after a preemption every token
        # but the newest. Blocks of it may come from the prefix cache (looked up once, before its first chunk).
        self.prefill_end = len(self.prompt_token_ids)
        self.prefix_checked = False
        self.resumed = False  # preempted and admitted again: its prefill samples nothing
        # Unseeded sampling draws from the global generator; a seed gives noise per output position instead
        # (PositionNoise), which makes the text independent of the drafts, the batch and earlier requests.
        self.noise = PositionNoise(params.seed) if params.seed is not None and not params.greedy else None
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.text = ""        # the output text, truncated at a stop string
        self.token_origins: list[str] = []   # per output token (outputs.TokenOrigin)
        self.token_text_ends: list[int] = []  # per output token: where its text ends in detok.text
        self.sent_text = 0    # chars of text already streamed
        self.sent_tokens = 0
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # SamplingParams.prompt_logprobs (the first of n samples computes them; the first token has none)
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None)
        self.metrics = RequestMetrics(arrival_time=time.time())
        self.prediction_ids: list[int] | None = None  # SamplingParams.prediction's tokens (the engine sets them)
        self.bad_words_ids: list[list[int]] = []  # SamplingParams.bad_words as token sequences (the engine sets them)
        self.matcher: Matcher | None = None  # SamplingParams.structured_outputs's grammar state (the engine sets it)
        self.spec = SpecState()  # the proposer's and its adaptive-k policy's state, which goes with the request

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_end

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are asked for and not all computed: its prompt rows all need their logits, and
        no prefix may come from the cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def argmax_rows(self) -> bool:
        """Whether each of this request's tokens is the argmax of its row: the logits' for greedy requests,
        probabilities over the position's noise for seeded ones (``PositionNoise``)."""
        return self.params.greedy or self.noise is not None

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED

    def completion(self, delta: bool = False) -> CompletionOutput:
        m = self.metrics
        if self.prediction_ids and self.finished and m.accepted_prediction_tokens is None:  # once, when done
            from specdecode.speculative.prediction import prediction_usage

            m.accepted_prediction_tokens, m.rejected_prediction_tokens = prediction_usage(self.prediction_ids,
                                                                                          self.output_token_ids)
        text, ids = self.text, self.output_token_ids
        origins, ends = self.token_origins, self.token_text_ends
        if len(ends) and ends[-1] > len(text):  # the text was cut at a stop string
            ends = [min(e, len(text)) for e in ends]
        if delta:
            text, ids = text[self.sent_text:], ids[self.sent_tokens:]
            origins, ends = origins[self.sent_tokens:], [e - self.sent_text for e in ends[self.sent_tokens:]]
        lp = self.logprobs
        if lp is not None and delta:
            lp = lp[self.sent_tokens:]
        return CompletionOutput(self.index, text, list(ids), self.cumulative_logprob if lp is not None else None,
                                lp, self.finish_reason, self.stop_reason, list(origins), list(ends))

    def to_output(self, delta: bool = False) -> RequestOutput:
        out = RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [self.completion(delta)],
                            self.finished, self.metrics, self.error,
                            None if self.needs_prompt_logprobs else self.prompt_logprobs)
        if delta:
            self.sent_text, self.sent_tokens = len(self.text), self.num_output_tokens
        return out
