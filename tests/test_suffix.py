"""Suffix decoding: drafts from the request's own context and from earlier requests' outputs, sized by how
often each continuation occurred; exact greedy output; learning across requests; bounded memory."""
from __future__ import annotations

import pytest

from specdecode.speculative.state import SpecState
from specdecode.speculative.suffix import SuffixCache, SuffixProposer

from fake_request import FakeRequest
from helpers_spec import GREEDY, PROMPTS, gen_ids, llm_cache, noisy_drafts, one_thread  # noqa: F401


def req(tokens: list[int], prompt_len: int | None = None) -> FakeRequest:
    n = len(tokens) if prompt_len is None else prompt_len
    return FakeRequest(all_token_ids=list(tokens), prompt_token_ids=list(tokens[:n]),
                       output_token_ids=list(tokens[n:]), spec=SpecState())


def test_own_context_continues_the_latest_match():
    p = SuffixProposer(min_token_prob=0.0, max_spec_factor=4.0)
    r = req([1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3])
    assert p.find(r, r.all_token_ids, 3) == [4, 5, 6]
    assert p.find(r, r.all_token_ids, 0) == []
    assert p.find(req([7, 8, 9]), [7, 8, 9], 4) == []  # nothing seen before


def test_draft_length_follows_match_length_and_tree_depth():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 50, 2, 3]
    r = req(tokens)
    assert SuffixProposer(max_spec_factor=1.0).find(r, tokens, 8) == [4, 5]       # 2-token match: 2 tokens
    assert SuffixProposer(max_spec_factor=2.5).find(r, tokens, 8) == [4, 5, 6, 7, 8]
    assert SuffixProposer(max_spec_factor=4.0, max_tree_depth=5).find(r, tokens, 8) == [4, 5, 6]  # 2 + 3 <= 5


def test_frequencies_decide_the_draft_and_where_it_stops():
    # After "0 1 2" (each time after a different token): "3 4 8", "3 7", "5", "3 4 11". 3 follows in 3/4,
    # then 4 in 2/4, then 8 or 11 in 1/4 each (a tie: the latest occurrence's).
    seq = [9, 0, 1, 2, 3, 4, 8, 0, 1, 2, 3, 7, 6, 0, 1, 2, 5, 5, 0, 1, 2, 3, 4, 11, 0, 1, 2]
    r = req(seq)
    assert SuffixProposer(min_token_prob=0.0, max_spec_factor=8).find(r, seq, 3) == [3, 4, 11]
    assert SuffixProposer(min_token_prob=0.3, max_spec_factor=8).find(r, seq, 3) == [3, 4]   # 1/4 < 0.3
    assert SuffixProposer(min_token_prob=0.6, max_spec_factor=8).find(r, seq, 3) == [3]      # 2/4 < 0.6
    assert SuffixProposer(min_token_prob=0.8, max_spec_factor=8).find(r, seq, 3) == []       # 3/4 < 0.8
    # A longer match is more reliable: the one occurrence that matches "8 0 1 2" decides on its own.
    longer = seq[:-3] + [8, 0, 1, 2]
    assert SuffixProposer(min_token_prob=0.0, max_spec_factor=8).find(req(longer), longer, 3) == [3, 7, 6]


def test_outputs_of_finished_requests_draft_for_later_ones():
    p = SuffixProposer(max_spec_factor=4.0)
    first = req([5, 6, 7, 1, 2, 3, 4, 20, 21, 22, 23], prompt_len=3)
    p.finish(first)
    later = req([9, 9, 1, 2, 3])  # a new request whose context ends like the cached output's
    assert p.find(later, later.all_token_ids, 6) == [4, 20, 21, 22, 23]
    # Without a global cache the request only has its own context, where nothing matches.
    alone = SuffixProposer(max_spec_factor=4.0, max_cached_requests=0)
    alone.finish(first)
    assert alone.find(later, later.all_token_ids, 6) == []


def test_cache_keeps_the_latest_requests_and_forgets_the_rest():
    cache = SuffixCache(max_requests=2, depth=8)
    outputs = [[1, 2, 3, 10 + i, 11 + i, 12 + i] for i in range(5)]
    for out in outputs:
        cache.add([0], out)
    assert len(cache.seqs) == 2 and cache.num_tokens == 2 * 7
    # Only the two latest requests' positions remain in the index.
    tags = {e >> 32 for arr in cache.index.where.values() for e in arr}
    assert tags == set(cache.seqs)
    p = SuffixProposer(max_spec_factor=4.0, min_token_prob=0.0, cache=cache)
    r = req([7, 1, 2, 3])
    assert p.find(r, r.all_token_ids, 2) in ([14, 15], [13, 14])  # never an evicted request's continuation
    assert sum(len(a) for a in cache.index.where.values()) == 2 * 5  # positions 2.. of each kept sequence


def test_each_drafted_token_carries_its_evidence_and_learns_its_rate():
    """A lookup's tokens carry (share, occurrences, match length); their acceptance chances come from what
    verifications taught about tokens with such evidence, and only from the request's own context's lookup."""
    seq = [9, 0, 1, 2, 3, 4, 8, 0, 1, 2, 3, 7, 6, 0, 1, 2, 5, 5, 0, 1, 2, 3, 4, 11, 0, 1, 2]
    p = SuffixProposer(min_token_prob=0.0, max_spec_factor=8)
    r = req(seq)
    found = p.find(r, r.all_token_ids, 3)
    assert found == [3, 4, 11]
    drafted, evidence = r.spec.suffix_found
    assert drafted == found and [e[0] for e in evidence] == [0.75, 0.5, 0.25]
    assert all(e[1] == 4 and e[2] == 3 for e in evidence)  # 4 occurrences of the 3-token match "0 1 2"
    before = p.found_rates(r, found)
    assert before[0] > before[1] > before[2]  # before any verification: the shares' order
    assert p.found_rates(r, [3, 4]) is None  # not what the last lookup found
    # Verifications where the contested third token is always rejected, the first two always accepted.
    for _ in range(30):
        p.find(r, r.all_token_ids, 3)
        p.score_found(r, [3, 4, 7])
        assert r.spec.suffix_found is None  # scored once
    p.find(r, r.all_token_ids, 3)
    after = p.found_rates(r, found)
    assert after[0] > before[0] and after[1] > before[1] and after[2] < 0.05
    # A lookup extended by drafts (HybridProposer's copies) is not the one scored.
    p.find(r, r.all_token_ids + [3], 2)
    assert r.spec.suffix_found[0] == found


def test_suffix_config_is_validated():
    from specdecode.config import speculative_config

    cfg = speculative_config({"method": "suffix", "num_speculative_tokens": 8})
    assert (cfg.method, cfg.suffix_decoding_max_tree_depth, cfg.suffix_decoding_max_cached_requests,
            cfg.suffix_decoding_max_spec_factor, cfg.suffix_decoding_min_token_prob) == ("suffix", 24, 10000, 1.0, 0.1)
    for bad in ({"suffix_decoding_max_tree_depth": 0}, {"suffix_decoding_max_cached_requests": -1},
                {"suffix_decoding_max_spec_factor": 0}, {"suffix_decoding_min_token_prob": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            speculative_config({"method": "suffix", **bad})


@pytest.mark.parametrize("with_draft", [False, True])
def test_suffix_greedy_equals_plain(with_draft, one_thread, llm_cache, tiny_models, noisy_drafts):
    """speculative_config={"method": "suffix", "num_speculative_tokens": 8} (and with a draft model: suffix
    matches first, the draft model elsewhere) gives plain greedy's ids, batched, and drafts are accepted."""
    plain = gen_ids(llm_cache.get(tiny_models["llama"]), PROMPTS, max_tokens=32, **GREEDY)
    sc = {"method": "suffix", "num_speculative_tokens": 8}
    if with_draft:
        sc.update(model=str(noisy_drafts["llama"]), num_speculative_tokens=3, prompt_lookup_num_tokens=8)
    llm = llm_cache.get(tiny_models["llama"], speculative_config=sc)
    assert gen_ids(llm, PROMPTS, max_tokens=32, **GREEDY) == plain
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > 0
    if with_draft:
        assert llm.engine.draft_runner.num_passes > 0


def _mean_acceptance_length(llm, prompts) -> float:
    s = llm.engine.spec_stats
    d0, a0 = s.num_drafts, s.num_accepted_tokens
    for p in prompts:  # one at a time, as an agent's calls come in
        gen_ids(llm, [p], max_tokens=40, **GREEDY)
    return 1 + (s.num_accepted_tokens - a0) / max(1, s.num_drafts - d0)


def test_a_repeated_workload_is_drafted_better_the_second_time(one_thread, llm_cache, tiny_models):
    """Requests that come back (an agent re-running the same edits) are drafted from the cached outputs of the
    first round: the mean acceptance length rises, and it does not without the global cache."""
    import random

    rng = random.Random(1)
    prompts = [[rng.randrange(1, 500) for _ in range(12)] for _ in range(6)]
    plain = gen_ids(llm_cache.get(tiny_models["llama"]), prompts, max_tokens=40, **GREEDY)
    mal = {}
    for cached in (10000, 0):
        llm = llm_cache.get(tiny_models["llama"], speculative_config={
            "method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_cached_requests": cached})
        mal[cached] = [_mean_acceptance_length(llm, prompts) for _ in range(2)]
        assert gen_ids(llm, prompts, max_tokens=40, **GREEDY) == plain
    assert mal[10000][1] > mal[10000][0] + 1.0, mal
    assert mal[0][1] == pytest.approx(mal[0][0]), mal  # each request alone: the same drafts both rounds
