"""N-gram (prompt lookup) proposer: longest suffix first, min/max bounds, latest match, k cap."""
from __future__ import annotations

import random

import numpy as np
import pytest

from specdecode.speculative.ngram import NgramProposer, ngram_lookup

from fake_request import FakeRequest


def longest_match(tokens: list[int], n_min: int, n_max: int) -> tuple[int, list[int]]:
    """The specification: the largest n in [n_min, n_max] whose last-n-token suffix also occurs earlier with
    at least one token after it, and the start positions of those earlier occurrences; (0, []) if none."""
    total = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if n >= total:
            continue
        suffix = tokens[total - n:]
        starts = [s for s in range(total - n) if tokens[s:s + n] == suffix]
        if starts:
            return n, starts
    return 0, []


def check_proposal(tokens: list[int], k: int, n_min: int, n_max: int, got: list[int]) -> None:
    """got must copy what followed an occurrence of the longest matching suffix: got[i] == ext[s + n + i]
    where ext = tokens + got (so a copy may run on into its own proposal, as in periodic text)."""
    n, starts = longest_match(tokens, n_min, n_max)
    if not starts:
        assert got == [], (tokens, got)
        return
    assert 1 <= len(got) <= k, (tokens, k, got)
    ext = tokens + got
    assert any(all(ext[s + n + i] == t for i, t in enumerate(got)) for s in starts), (tokens, n, got)


def test_longest_suffix_wins_over_a_later_shorter_match():
    # suffix [1, 2, 3]: the 3-gram occurs at the start (followed by 50); the 2-gram [2, 3] occurs later
    # (followed by 60). The longest match must win even though the shorter one is more recent.
    toks = [1, 2, 3, 50, 51, 9, 2, 3, 60, 61, 8, 1, 2, 3]
    assert ngram_lookup(toks, 2, 1, 3) == [50, 51]
    assert ngram_lookup(toks, 2, 1, 4) == [50, 51]  # no 4-gram match: falls back to 3
    # Capping n_max at 2 makes the later 2-gram match the answer.
    assert ngram_lookup(toks, 2, 1, 2) == [60, 61]


def test_latest_occurrence_of_the_same_length():
    """The tie-break documented in ngram_lookup: among matches of the same length, the latest one."""
    toks = [7, 8, 1, 7, 8, 2, 7, 8, 3, 4, 7, 8]
    assert ngram_lookup(toks, 1, 2, 2) == [3]
    assert ngram_lookup(toks, 3, 2, 2) == [3, 4, 7]


def test_min_length_is_respected():
    # Only a 1-gram ([5]) matches; with n_min = 2 there is nothing to propose.
    toks = [5, 11, 12, 13, 14, 6, 5]
    assert ngram_lookup(toks, 3, 1, 3) == [11, 12, 13]
    assert ngram_lookup(toks, 3, 2, 3) == []


def test_a_copy_runs_on_into_its_own_proposal():
    """The latest match of a short cycle ends near the context's end; the copy continues the cycle up to k."""
    assert ngram_lookup([5, 6, 5, 6, 5, 6, 5], 6, 1, 2) == [6, 5, 6, 5, 6, 5]
    assert ngram_lookup([4, 4, 4], 8, 1, 2) == [4] * 8
    assert ngram_lookup([9, 1, 2, 3, 1, 2], 7, 2, 2) == [3, 1, 2, 3, 1, 2, 3]


def test_nothing_matches_returns_empty():
    assert ngram_lookup([1, 2, 3, 4, 5, 6], 4, 1, 4) == []
    assert ngram_lookup([9], 4, 1, 4) == []  # a single token has no earlier context
    assert ngram_lookup([], 4, 1, 4) == []


def test_k_caps_the_proposal():
    toks = [1, 2, 10, 11, 12, 13, 14, 15, 1, 2]
    for k in range(1, 7):
        assert ngram_lookup(toks, k, 1, 2) == [10, 11, 12, 13, 14, 15][:k]
    for k in (1, 3, 8):
        for toks in ([4, 4, 4], [1, 2, 3, 1, 2], [5, 6, 5, 6, 5, 6, 5]):
            got = ngram_lookup(toks, k, 1, 2)
            check_proposal(toks, k, 1, 2, got)
            assert got[0] == {4: 4, 2: 3, 5: 6}[toks[-1]]


def test_numpy_input_and_plain_ints():
    out = ngram_lookup(np.array([3, 4, 5, 3, 4], dtype=np.int32), 2, 1, 2)
    assert out == [5, 3]
    assert all(type(t) is int for t in out)


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (1, 3), (2, 4), (3, 3), (1, 6)])
def test_longest_suffix_property_on_random_sequences(n_min, n_max):
    rng = random.Random(n_min * 100 + n_max)
    nonempty = 0
    for _ in range(400):
        length = rng.randint(0, 40)
        alphabet = rng.randint(2, 6)  # small alphabets: many matches of every length
        toks = [rng.randrange(alphabet) for _ in range(length)]
        k = rng.randint(1, 8)
        got = ngram_lookup(toks, k, n_min, n_max)
        check_proposal(toks, k, n_min, n_max, got)
        nonempty += bool(got)
    assert nonempty > 100


def test_property_checker_rejects_wrong_answers():
    """The checker itself can fail: a proposal from a shorter match, or a wrong continuation."""
    toks = [1, 2, 3, 50, 51, 9, 2, 3, 60, 61, 8, 1, 2, 3]
    check_proposal(toks, 2, 1, 3, [50, 51])
    for wrong in ([60, 61], [50, 52], [], [50, 51, 9]):
        with pytest.raises(AssertionError):
            check_proposal(toks, 2, 1, 3, wrong)


def test_proposer_uses_prompt_plus_output_and_respects_per_request_k():
    prop = NgramProposer(n_min=1, n_max=3)
    reqs = [FakeRequest(all_token_ids=[1, 2, 3, 4, 5, 1, 2, 3]),   # 3-gram match -> 4, 5, 1, ...
            FakeRequest(all_token_ids=[9, 8, 7]),                  # no match
            FakeRequest(all_token_ids=[6, 6, 6, 6])]               # k = 0: speculation off for it
    p = prop.propose(reqs, [2, 4, 0])
    assert p.tokens == [[4, 5], [], []]
    assert p.probs is None  # n-gram drafts are one-hot
    prop.rollback(reqs[0], 3)  # stateless: must not fail or change anything
    assert prop.propose(reqs, [5, 1, 1]).tokens == [[4, 5, 1, 2, 3], [], [6]]
