"""Prompt-lookup drafting: find the latest earlier occurrence of the context's suffix and copy what followed."""
from __future__ import annotations

import numpy as np

from specdecode.speculative.proposer import Proposal


def ngram_lookup(tokens: list[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """k tokens copied from after the latest earlier match of the longest suffix (n_max down to n_min), or
    none if nothing matches."""
    toks = np.asarray(tokens, dtype=np.int64)
    total = len(toks)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        suffix = toks[total - n:]
        # candidate starts i with toks[i:i+n] == suffix and i + n < total (something follows the match)
        windows = np.lib.stride_tricks.sliding_window_view(toks[:total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            # The latest match is often close to the end (text that repeats a short cycle), leaving fewer
            # than k tokens after it. The copy then runs on into its own output, as an LZ77 copy does
            # (np.resize repeats what is there cyclically), which keeps the cycle going for all k.
            start = int(hits[-1]) + n
            return np.resize(toks[start:start + k], k).tolist()
    return []


class NgramProposer:
    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, requests: list, ks: list[int]) -> Proposal:
        return Proposal([ngram_lookup(r.all_token_ids, k, self.n_min, self.n_max) if k > 0 else []
                         for r, k in zip(requests, ks)])

    def rollback(self, request, valid_len: int) -> None:
        pass  # stateless
