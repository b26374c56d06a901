"""Prompt-lookup drafting: find the latest earlier occurrence of the context's suffix and copy what followed."""
from __future__ import annotations

import numpy as np

from specdecode.speculative.adaptive import AdaptiveK
from specdecode.speculative.prediction import predicted
from specdecode.speculative.proposer import Proposal, Proposer
from specdecode.speculative.suffix_match import longest_suffix_matches


def ngram_lookup(tokens: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """k tokens copied from after the latest earlier match of the longest suffix (n_max down to n_min), or
    none if nothing matches."""
    toks = np.asarray(tokens, dtype=np.int64)
    if len(toks) < 2 or k <= 0:
        return []
    hits = longest_suffix_matches(toks, toks, n_min, n_max)
    if not hits.size:
        return []
    # The latest match is often close to the end (text that repeats a short cycle), leaving fewer than k tokens
    # after it. The copy then runs on into its own output, as an LZ77 copy does (np.resize repeats what is there
    # cyclically), which keeps the cycle going for all k.
    start = int(hits[-1]) + 1
    return np.resize(toks[start:start + k], k).tolist()


class NgramProposer(Proposer):
    """Prompt lookup (vLLM's ``ngram`` method). Also the lookup source of HybridProposer (``find``)."""

    drafts_by_lookup = True

    def __init__(self, n_min: int, n_max: int, k: int | None = None, policy: AdaptiveK | None = None):
        super().__init__(k, policy)
        self.n_min, self.n_max = n_min, n_max

    def find(self, request, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the suffix of ``tokens`` (the
        request's context, possibly extended by drafts); from the request's predicted output first, where it
        has one."""
        return predicted(request, tokens, k) or ngram_lookup(tokens, k, self.n_min, self.n_max)

    def propose(self, requests: list, budgets: list[int]) -> Proposal:
        return self.propose_lookups(requests, budgets)

    def observe(self, request, drafted: list[int], accepted: int, emitted: list[int]) -> None:
        self.policy.learn(request, drafted, accepted, True, [], emitted, None)
