"""The proposer interface: the calls the engine makes, and nothing else.

Each step the engine asks ``propose(requests, budgets)`` for drafts, verifies them in one target pass,
rejection-samples, commits, and then reports back per request: ``rollback`` (which tokens are final) and
``observe`` (what was drafted, accepted and emitted). A proposer owns its whole policy behind these calls:
how deep to draft (adaptive k), which of its sources to use (lookup or draft model) and what it learns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.layers.sampler import top_probability
from specdecode.speculative.adaptive import AdaptiveK, CostModel


def context_of(request) -> list[int]:
    """The tokens a proposer drafts after: the request's committed tokens, then the step's ``draft_prefix``
    (tokens the engine drafts itself ahead of the proposer's, the grammar's forced text; usually none)."""
    prefix = request.draft_prefix
    return request.all_token_ids + prefix if prefix else request.all_token_ids


def reads_draft_probs(request) -> bool:
    """Whether verification reads the request's draft probabilities: an unseeded sampled request's rejection
    test does; greedy and seeded requests are verified by the argmax of their rows (``Request.argmax_rows``)."""
    return not request.argmax_rows


@dataclass
class Proposal:
    tokens: list[list[int]]              # per request, 0..budget draft tokens
    probs: torch.Tensor | None = None    # [R, max_k, V] draft distributions; None means one-hot drafts


def widened(probs: torch.Tensor, width: int) -> torch.Tensor:
    """[R, K, V] draft probabilities with at least ``width`` positions (zero rows added)."""
    need = width - probs.shape[1]
    return torch.cat([probs, probs.new_zeros(probs.shape[0], need, probs.shape[2])], 1) if need > 0 else probs


def one_hot_rows(probs: torch.Tensor, i: int, start: int, toks: list[int]) -> torch.Tensor:
    """probs (widened if needed) with request i's rows start.. set to one-hot rows for toks: drafts proposed
    with certainty (copied from the context, or forced by a grammar)."""
    probs = widened(probs, start + len(toks))
    probs[i, start:start + len(toks)] = 0.0
    probs[i, torch.arange(start, start + len(toks)), torch.tensor(toks, dtype=torch.long)] = 1.0
    return probs


class Proposer:
    """Base class: no-op hooks, so a proposer implements only the calls it needs.

    ``k`` caps the tokens one step drafts (None: only the engine's budget); ``policy`` decides k per request
    and learns from each verification (adaptive k)."""

    drafts_by_lookup = False  # it has a lookup source (``find``), which also drafts from predicted outputs

    def __init__(self, k: int | None = None, policy: AdaptiveK | None = None):
        self.k = k
        self.policy = policy if policy is not None else AdaptiveK()

    @property
    def costs(self) -> CostModel:
        """The pass costs and acceptance counts adaptive k decides with."""
        return self.policy.costs

    @costs.setter
    def costs(self, value: CostModel) -> None:
        self.policy.costs = value

    @property
    def max_k(self) -> int:
        """The most tokens one step drafts (what calibration must time verification passes for)."""
        return self.k or 1

    def calibrate(self, target, max_len: int, identity: dict, refresh: bool = False) -> CostModel:
        """Time (or take from the cost cache) the passes adaptive k weighs: target passes over up to
        max_k + 1 rows, and this proposer's draft step (with its own LM head, ``draft_head``). ``identity``: the
        engine's models and settings."""
        return self.policy.calibrate(target, self.draft_runner, self.max_k, max_len,
                                     dict(identity, head=self.head_identity()), refresh, self.draft_head)

    def head_identity(self) -> str | None:
        """What, besides the draft model's files, sets the cost of a draft step (a truncated head)."""
        return None

    def caps(self, budgets: list[int], k: int | None = None) -> list[int]:
        """Per request: the most tokens to draft, the budget clamped to k (default: this proposer's k)."""
        k = self.k if k is None else k
        return [max(0, b if k is None else min(k, b)) for b in budgets]

    def note_target(self, request, logits: torch.Tensor) -> None:
        """The target's logits [V] at the first position of request's step (its prefill's last position, then
        each verification's first row). Adaptive k with a draft model notes the target's confidence there
        (``AdaptiveK.note_confidence``): it says how well the draft model would do before it drafts."""
        if self.policy.enabled and self.draft_runner is not None and not self.policy.drafting_hopeless:
            self.policy.note_confidence(request, top_probability(logits))

    def prefill(self, request) -> None:
        """A new request's prompt is in the target's cache."""

    def expect_batch(self, size: int) -> None:
        """The engine holds ``size`` requests (decoding, prefilling or waiting, at most its slots): the batch
        the next steps will soon have, which one-off draft work must still pay at."""
        self.policy.expected_batch = size

    def propose(self, requests: list, budgets: list[int]) -> Proposal:
        """Draft tokens for each request, at most budgets[i] for request i (0: none), after its context
        (``context_of``: where the engine drafts a prefix itself, the proposer's drafts follow it)."""
        raise NotImplementedError

    def draft_origins(self, request, n: int) -> list[str]:
        """Where the first ``n`` of this step's drafts for ``request`` came from ("lookup" or "draft", as in
        outputs.TokenOrigin); asked after verification, before ``observe``."""
        return ["lookup" if self.drafts_by_lookup else "draft"] * n

    def observe(self, request, drafted: list[int], accepted: int, emitted: list[int]) -> None:
        """The verification of request's drafts: the first ``accepted`` were kept, ``emitted`` were committed
        (accepted drafts plus the target's own token, cut where the request stops)."""

    def rollback(self, request, length: int) -> None:
        """The first ``length`` tokens of request.all_token_ids are final; forget anything cached past them."""

    def finish(self, request) -> None:
        """The request is done (its output is complete)."""
        self.policy.finished(request)

    def propose_lookups(self, requests: list, budgets: list[int]) -> Proposal:
        """``propose`` for a model-free proposer with ``find(request, tokens, k)``: each request's lookup up to
        its cap, cut to the depth the policy's plan for the batch gives it."""
        caps = self.caps(budgets)
        found = [self.find(r, context_of(r), cap) if cap else [] for r, cap in zip(requests, caps)]
        plan = self.policy.plan(requests, budgets, [len(f) for f in found], [0] * len(requests),
                                [self.found_rates(r, f) for r, f in zip(requests, found)])
        return Proposal([f[:k] for f, (_, k) in zip(found, plan)])

    # ---- a lookup source's calls (``find`` and these two), for itself and for HybridProposer ----
    def find(self, request, tokens: list[int], k: int) -> list[int]:
        """A lookup source's draft (NgramProposer, SuffixProposer): up to k tokens that should follow ``tokens``
        (request's context, possibly extended by drafts), from its predicted output first where it has one."""
        raise NotImplementedError

    def found_rates(self, request, found: list[int]) -> list[float] | None:
        """For the lookup ``find`` just returned for request's context: each token's chance of acceptance,
        given every token before it was accepted. None: the policy uses the request's own lookup rates."""
        return None

    def score_found(self, request, emitted: list[int]) -> None:
        """The step's verification emitted ``emitted``: what this lookup source learns from it about its last
        lookup for request, whether that lookup was drafted or not."""

    @property
    def draft_runner(self):
        """The draft model's ModelRunner this proposer runs, or None (model-free drafting)."""
        return None

    @property
    def draft_head(self) -> torch.nn.Module | None:
        """The LM head this proposer's draft model scores with (its full head or a truncated one); None
        without a draft model."""
        return None

    @property
    def prefill_seconds(self) -> float:
        """Seconds spent so far running the draft model over prompts (0 for model-free proposers)."""
        return 0.0
