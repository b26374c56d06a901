"""Where the latest tokens of a sequence occur in another (or earlier in itself): the search behind prompt lookup
and behind drafting from a predicted output."""
from __future__ import annotations

import numpy as np


def longest_suffix_matches(source: np.ndarray, query: np.ndarray, n_min: int, n_max: int) -> np.ndarray:
    """The positions j in ``source`` (something must follow each, so j < len(source) - 1) at which the longest
    suffix of ``query`` that occurs at all, n_max down to n_min tokens, ends; empty if none does. ``source`` may be
    ``query`` itself, for earlier occurrences of its own suffix."""
    total = len(query)
    # Every match ends at a position holding the query's last token: one pass finds those, and longer suffixes
    # only narrow them down, instead of comparing every window of every length.
    ends = np.flatnonzero(source[:len(source) - 1] == query[-1])
    for n in range(min(n_max, total), n_min - 1, -1):
        hits = ends[ends >= n - 1]
        for d in range(1, n):
            if not hits.size:
                break
            hits = hits[source[hits - d] == query[total - 1 - d]]
        if hits.size:
            return hits
    return ends[:0]
