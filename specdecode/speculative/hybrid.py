"""Lookup first, the draft model elsewhere (``ngram_first``; also suffix decoding with a draft model).

A lookup (prompt lookup or the suffix index) costs no model pass, and in text that copies from its context
or from earlier requests it is as good as the draft model or better; the draft model runs only for the
requests whose lookup finds nothing, or (adaptive k) whose lookups are expected to pay less than it does.
When the draft model's latest token completes a span the lookup knows, the rest of that span is appended
as a one-hot copy and ends the request's draft for the step.

With adaptive k each request keeps the two kinds' acceptance apart, and an unused lookup is still scored
against what the target emitted, so lookups that would have been right win their turn back. A step that drafts
from a lookup also feeds the draft model its unseen context where starting the draft model would have paid
(``AdaptiveK.plan`` marks it), so that a lookup found at a request's first step does not keep the draft model
out for the rest of the request.
"""
from __future__ import annotations

import torch

from specdecode.speculative.adaptive import AdaptiveK
from specdecode.speculative.draft_model import DraftModelProposer
from specdecode.speculative.proposer import Proposal, Proposer, context_of
from specdecode.speculative.state import DraftSources


class HybridProposer(Proposer):
    """``lookup`` (a proposer with ``find(request, tokens, k)``) first, ``draft`` where it finds nothing.
    ``k`` caps the draft model's tokens, ``lookup_k`` a lookup's; both share ``policy``."""

    drafts_by_lookup = True

    def __init__(self, lookup, draft: DraftModelProposer, k: int, lookup_k: int, policy: AdaptiveK):
        super().__init__(k, policy)
        self.lookup, self.draft, self.lookup_k = lookup, draft, lookup_k
        lookup.policy = draft.policy = policy

    @property
    def max_k(self) -> int:
        return max(self.k, self.lookup_k)

    def head_identity(self) -> str | None:
        return self.draft.head_identity()

    @property
    def draft_head(self) -> torch.nn.Module:
        return self.draft.draft_head

    @property
    def draft_runner(self):
        return self.draft.runner

    @property
    def prefill_seconds(self) -> float:
        return self.draft.prefill_seconds

    def prefill(self, request) -> None:
        self.lookup.prefill(request)
        self.draft.prefill(request)

    def propose(self, requests: list, budgets: list[int]) -> Proposal:
        for r in requests:
            r.spec.sources = DraftSources()
        caps, lookup_caps = self.caps(budgets), self.caps(budgets, self.lookup_k)
        if not any(caps) and not any(lookup_caps):
            return Proposal([[] for _ in requests])
        policy = self.policy
        contexts = [context_of(r) for r in requests]
        found = [self.lookup.find(r, c, cap) if cap else [] for r, c, cap in zip(requests, contexts, lookup_caps)]
        # One plan for the batch: per request a lookup, the draft model or neither (see AdaptiveK.plan).
        plan = policy.plan(requests, budgets, [len(f) for f in found], caps,
                           [self.lookup.found_rates(r, f) for r, f in zip(requests, found)])
        self.draft.warm_up([r for r in requests if r.spec.draft_warm_up])
        use, ks = [], []
        for r, f, (looked_up, k) in zip(requests, found, plan):
            use.append(f[:k] if looked_up else [])
            ks.append(0 if looked_up else k)
            r.spec.sources.found, r.spec.sources.looked_up = f, bool(looked_up and k)
        # With a confidence threshold the draft's own probabilities decide how deep it goes: adaptive k only
        # decides whether the draft model runs at all.
        depths = [cap if k else 0 for k, cap in zip(ks, caps)] if self.draft.confidence else ks
        depth: dict[int, int] = {}  # request -> lookup depth, fixed for the step: one estimate per request

        def extend(i: int, drafted: list[int]) -> list[int]:
            # The draft model's latest token may complete a span seen earlier: the model is starting to copy,
            # and the rest of the span costs no draft passes (one-hot drafts, like a lookup).
            r = requests[i]
            if lookup_caps[i] <= len(drafted):
                return []
            if i not in depth:
                depth[i] = policy.lookup_depth(r, lookup_caps[i])
            room = min(lookup_caps[i] - len(drafted), depth[i])
            if room <= 0:
                return []
            copied = self.lookup.find(r, contexts[i] + drafted, room)
            if copied:
                r.spec.sources.copied_from = len(drafted)
            return copied

        return self.draft.draft(requests, [0 if u else d for u, d in zip(use, depths)], lookups=use,
                                extend=extend)

    def draft_origins(self, request, n: int) -> list[str]:
        step = request.spec.sources or DraftSources()
        if step.looked_up:
            return ["lookup"] * n
        copied = n if step.copied_from is None else step.copied_from
        return ["draft" if j < copied else "lookup" for j in range(n)]

    def observe(self, request, drafted: list[int], accepted: int, emitted: list[int]) -> None:
        step = request.spec.sources or DraftSources()
        request.spec.sources = None
        self.lookup.score_found(request, emitted)
        self.policy.learn(request, drafted, accepted, step.looked_up, step.found or [], emitted, step.copied_from)

    def rollback(self, request, length: int) -> None:
        self.lookup.rollback(request, length)
        self.draft.rollback(request, length)

    def finish(self, request) -> None:
        self.policy.finished(request)
        self.lookup.finish(request)
        self.draft.finish(request)
