"""Adaptive k: the cost model's choices, and exactness plus clean cost accounting in the engine."""
from __future__ import annotations

import contextlib
import os

import pytest

from specdecode.speculative.adaptive import (PLAIN, PROBE_EVERY, Acceptance, AdaptiveK, CostModel, StepCosts,
                                             StepOption, calibration_rows, choose_k, draft_calibration_rows,
                                             expected_tokens, next_k, plan_step)
from specdecode.speculative.state import SpecState

from fake_request import FakeRequest
from helpers_spec import GREEDY, PROMPTS, gen_ids, llm_cache, noisy_drafts, one_thread  # noqa: F401


def _costs(verify: dict[int, float], draft_step: float) -> CostModel:
    c = CostModel()
    for rows, s in verify.items():
        c.add(0, rows, s)
    c.add_draft(0, draft_step)
    return c


def test_expected_tokens():
    assert expected_tokens(0.0, 0.9, 4) == pytest.approx(1.0)
    assert expected_tokens(1.0, 1.0, 4) == 5.0
    assert expected_tokens(0.5, 0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.5, 0.9, 2) == pytest.approx(1 + 0.5 + 0.5 * 0.9)
    assert expected_tokens(0.3, 0.9, 0) == 1.0


def test_uncalibrated_costs_use_the_full_k():
    assert choose_k(0.1, 0.1, 5, CostModel(), draft_is_free=False) == 5
    opts = [PLAIN, StepOption(True, 1, 1.5), StepOption(True, 2, 1.7), StepOption(False, 1, 1.5),
            StepOption(False, 4, 2.0)]
    assert plan_step([opts, [PLAIN, StepOption(False, 1, 1.5), StepOption(False, 3, 2.0)]], CostModel()) == [2, 2]


def test_low_acceptance_or_dear_drafts_turn_speculation_off():
    flat = {1: 0.10, 2: 0.11, 4: 0.13, 8: 0.2}  # verification nearly free, as on a GPU
    assert choose_k(0.05, 0.05, 6, _costs(flat, 0.01), draft_is_free=False) == 0   # drafts almost never accepted
    assert choose_k(0.9, 0.9, 6, _costs(flat, 0.20), draft_is_free=False) == 0    # a draft step dearer than a target step
    linear = {1: 0.10, 2: 0.20, 4: 0.40, 8: 0.8}  # every extra row costs a full pass: nothing can pay
    assert choose_k(0.99, 0.99, 6, _costs(linear, 0.0), draft_is_free=True) == 0


def test_high_acceptance_with_cheap_verification_drafts_deep():
    flat = {1: 0.10, 2: 0.10, 4: 0.10, 8: 0.10}
    assert choose_k(0.95, 0.95, 6, _costs(flat, 0.0), draft_is_free=True) == 6
    k = choose_k(0.8, 0.8, 6, _costs(flat, 0.02), draft_is_free=False)
    assert 2 <= k <= 6


def test_a_modest_expected_gain_leaves_plain_decoding_and_a_tie_does_not():
    """A draft model turned down at a request's first step seldom gets a second chance (its catch-up grows
    while the tokens left to repay it shrink), so a 7% expected gain is taken; 3% is within the noise."""
    costs = _costs({1: 0.100, 2: 0.101}, 0.020)  # k = 1: (1 + p) tokens per 0.121 s against 1 per 0.100 s

    def p_for(gain: float) -> float:
        return gain * 1.21 - 1.0

    assert choose_k(p_for(1.07), p_for(1.07), 1, costs, draft_is_free=False) == 1
    assert choose_k(p_for(1.03), p_for(1.03), 1, costs, draft_is_free=False) == 0


def test_acceptance_counts_first_tokens_and_tokens_inside_a_run_apart():
    a = Acceptance(decay=1.0)
    a.observe(4, 0)  # cold: the first token fails
    assert (a.first_ok, a.first_n, a.next_ok, a.next_n, a.in_run) == (0, 1, 0, 0, False)
    a.observe(4, 2)  # cold: first passes, the second passes, the third fails
    assert (a.first_ok, a.first_n, a.next_ok, a.next_n, a.in_run) == (1, 2, 1, 2, False)
    a.observe(3, 3)  # cold and fully accepted: the next step starts inside a run
    assert (a.first_ok, a.first_n, a.next_ok, a.next_n, a.in_run) == (2, 3, 3, 4, True)
    a.observe(4, 1)  # inside a run: every trial is a "next" one
    assert (a.first_ok, a.first_n, a.next_ok, a.next_n, a.in_run) == (2, 3, 4, 6, False)
    assert a.rates() == (pytest.approx(2.7 / 4), pytest.approx(4.7 / 7))  # plus one neutral trial at 0.7
    a.observe(2, 2)
    assert a.in_run and a.rates()[0] == a.rates()[1]  # inside a run the first token is a "next" one
    a.observe(0, 0)  # a plain step ends the run and teaches nothing
    assert not a.in_run and (a.first_n, a.next_n) == (4, 7)


def test_a_run_of_acceptances_drafts_deeper_than_the_start_of_one():
    # Verification that gets dearer with rows, as on a CPU; drafts rarely start well but, once one is
    # accepted, the rest of the run usually is (a copied span).
    costs = _costs({1: 0.10, 2: 0.102, 4: 0.12, 6: 0.15, 9: 0.21}, 0.0)
    a = Acceptance(decay=1.0, first_ok=3, first_n=10, next_ok=9, next_n=10)
    cold = choose_k(*a.rates(), 8, costs, draft_is_free=True)
    a.in_run = True
    hot = choose_k(*a.rates(), 8, costs, draft_is_free=True)
    assert 1 <= cold <= 3 and hot >= 5


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_adaptive_greedy_equals_plain(proposer, one_thread, llm_cache, tiny_models, noisy_drafts):
    plain = gen_ids(llm_cache.get(tiny_models["llama"]), PROMPTS, max_tokens=24, **GREEDY)
    spec = noisy_drafts["llama"] if proposer == "draft" else "[ngram]"
    llm = llm_cache.get(tiny_models["llama"], speculative_model=spec, num_speculative_tokens=4,
                        speculative_adaptive=True)
    for p, want in zip(PROMPTS, plain):  # batch 1, so the cost model learns
        assert gen_ids(llm, [p], max_tokens=24, **GREEDY)[0] == want
    # Calibrated when the engine started: every timed row count after a short and a long context.
    costs = llm.engine.proposer.costs
    assert len(costs.verify) == 2
    # Row counts up to the engine's batch all drafting, where they fit after the context.
    batch, max_len = llm.engine.config.max_num_seqs, llm.engine.max_model_len
    for ctx, table in costs.verify.items():
        assert sorted(table) == [n for n in calibration_rows(4, batch) if ctx + n <= max_len]
        assert all(s > 0 for s in table.values())
    assert (sorted(costs.draft) == sorted(costs.verify)) == (proposer == "draft")
    assert all(s > 0 for s in costs.draft.values())
    if proposer == "draft":  # batched draft steps too
        for ctx, table in costs.draft_rows.items():
            assert sorted(table) == [n for n in draft_calibration_rows(batch) if ctx + n <= max_len]


def _high() -> Acceptance:
    return Acceptance(decay=1.0, first_ok=90, first_n=100, next_ok=90, next_n=100)


def test_probes_back_off_while_speculation_does_not_pay_and_reset_when_it_does():
    dear = _costs({1: 0.10, 2: 0.20, 4: 0.40}, 0.05)  # nothing pays: every decision is k = 0
    s = _high()  # its probing state is kept with its counts
    ks = [next_k(3, s, dear, draft_is_free=False) for _ in range(PROBE_EVERY * 7)]
    probes = [i for i, k in enumerate(ks) if k]
    assert set(ks) <= {0, 1}
    gaps = [b - a for a, b in zip([-1] + probes, probes)]
    assert gaps == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY]  # each unfruitful probe doubles the wait
    cheap = _costs({1: 0.10, 2: 0.10, 4: 0.10}, 0.0)
    assert next_k(3, s, cheap, draft_is_free=True) == 3
    assert (s.steps_without_spec, s.probe_every) == (0, PROBE_EVERY)


def test_new_requests_start_from_the_acceptance_seen_so_far():
    c = CostModel()
    assert Acceptance().rates(c.prior) == (pytest.approx(0.7), pytest.approx(0.7))
    for _ in range(100):
        c.observe_acceptance(Acceptance(), 4, 0)  # every draft rejected at once
    p1, _ = Acceptance().rates(c.prior)
    assert p1 < 0.05
    c.observe_acceptance(Acceptance(), 0, 0)  # a plain step: nothing learned
    assert Acceptance().rates(c.prior)[0] == p1


def test_a_draft_model_that_sat_out_is_tried_again_after_a_few_requests():
    """Bad drafts teach new requests to leave the draft model off; steps that then do not draft with it must
    not freeze that verdict (a draft model that sat out cannot be probed without a catch-up nobody pays for),
    so each one fades it towards the neutral guess: over a few long answers, not within one."""
    policy = AdaptiveK(enabled=True)
    c = policy.costs
    for _ in range(100):
        c.observe_acceptance(Acceptance(), 4, 0)
    assert Acceptance().rates(c.prior)[0] < 0.05

    def steps(n: int, looked_up: bool) -> None:
        r = FakeRequest(spec=SpecState())
        for _ in range(n):
            policy.learn(r, [7] if looked_up else [], int(looked_up), looked_up, [], [7], None)

    steps(20, looked_up=False)
    steps(20, looked_up=True)
    assert Acceptance().rates(c.prior)[0] < 0.1  # one answer's worth of plain and lookup steps: still off
    steps(500, looked_up=False)
    assert Acceptance().rates(c.prior)[0] > 0.5


def test_verify_cost_never_falls_as_rows_grow():
    c = _costs({1: 0.10, 4: 0.12, 6: 0.15, 7: 0.11, 9: 0.20}, 0.0)  # 7 rows measured low by noise
    costs = [c.verify_cost(r) for r in range(1, 12)]
    assert costs == sorted(costs)
    assert c.verify_cost(7) == pytest.approx(0.15) and c.verify_cost(2) == pytest.approx(0.10 + 0.02 / 3)
    assert CostModel().verify_cost(3) is None


def test_calibration_rows_cover_one_to_k_plus_one():
    assert calibration_rows(1) == [1, 2]
    assert calibration_rows(4) == [1, 2, 3, 5]
    assert calibration_rows(8) == [1, 2, 3, 5, 9]
    assert calibration_rows(10) == [1, 2, 3, 5, 9, 11]
    # A batch adds its plain step and doubling row counts up to every request drafting k_max (capped).
    assert calibration_rows(4, 8) == [1, 2, 3, 5, 8, 10, 20, 40]
    assert calibration_rows(12, 64)[-1] == 256
    assert draft_calibration_rows(1) == [1, 64] and draft_calibration_rows(6) == [1, 2, 4, 6, 64]


def test_costs_follow_the_context_length():
    c = CostModel()
    for ctx, base in ((100, 0.10), (500, 0.14)):
        c.add(ctx, 1, base)
        c.add(ctx, 5, base * 1.5)
        c.add_draft(ctx, base / 4)
    assert c.verify_cost(1, 0) == c.verify_cost(1, 100) == pytest.approx(0.10)      # flat below the shortest
    assert c.verify_cost(1, 300) == pytest.approx(0.12)                              # linear in between
    assert c.verify_cost(5, 900) == pytest.approx(0.21 + 0.06)                       # extrapolated beyond
    assert c.verify_cost(3, 100) == pytest.approx(0.125)                             # rows interpolated too
    assert c.draft_cost(300) == pytest.approx(0.03)
    # A long context makes extra rows dearer, which must show in the chosen k.
    c.add(2000, 1, 0.12)
    c.add(2000, 5, 0.5)
    c.add_draft(2000, 0.03)
    assert choose_k(0.6, 0.6, 4, c, draft_is_free=True, context=2000) < choose_k(0.6, 0.6, 4, c, True, 100)


@contextlib.contextmanager
def _busy(eng):
    """The engine with one request running, finished afterwards."""
    from specdecode.sampling_params import SamplingParams

    eng.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=4))
    try:
        yield eng
    finally:
        eng.abort_request("busy")
        while eng.has_unfinished_requests():
            eng.step()


def test_a_busy_engine_refuses_to_calibrate(one_thread, llm_cache, tiny_models):
    llm = llm_cache.get(tiny_models["llama"], speculative_model="[ngram]", num_speculative_tokens=2,
                        speculative_adaptive=True)
    with _busy(llm.engine) as eng, pytest.raises(RuntimeError, match="idle engine"):
        eng.calibrate_costs()


def test_reset_speculative_state_forgets_what_was_learned(one_thread, llm_cache, tiny_models, tiny_draft):
    """A benchmark's warm-up must not teach the policy (a 16-token warm-up reads as a short answer, which keeps
    the draft model off at the start of the next requests): after reset_speculative_state() the proposer starts
    afresh from the calibrated costs, and greedy output is unchanged."""
    llm = llm_cache.get(tiny_models["llama"], speculative_model=str(tiny_draft), num_speculative_tokens=3,
                        speculative_adaptive=True, speculative_ngram_first=True)
    eng = llm.engine
    first = gen_ids(llm, PROMPTS[:1], max_tokens=6, **GREEDY)
    old = eng.proposer
    assert old.policy._lengths[-1] == 6
    eng.reset_speculative_state()
    new = eng.proposer
    assert new is not old and new.policy._lengths == [] and eng.config.speculative.method == "draft_model"
    assert new.costs.prior.first_n == new.costs.lookup_prior.first_n == 0
    assert new.costs.verify_cost(2) == old.costs.verify_cost(2)  # the timed pass costs are kept
    assert gen_ids(llm, PROMPTS[:1], max_tokens=6, **GREEDY) == first
    with _busy(eng), pytest.raises(RuntimeError, match="idle engine"):
        eng.reset_speculative_state()


def test_a_rate_nobody_observes_drifts_back_instead_of_freezing():
    c = CostModel()
    for _ in range(30):
        c.observe_acceptance(Acceptance(), 4, 1)  # the second token always fails: "next" looks hopeless
    assert c.prior.kind_rates()[1] < 0.1
    for _ in range(300):
        c.observe_acceptance(Acceptance(), 1, 1)  # single-token drafts teach only the "first" rate
    assert c.prior.kind_rates()[1] > 0.5


def test_a_run_always_drafts_at_least_one_more_token():
    dear = _costs({1: 0.10, 2: 0.20, 4: 0.40}, 0.05)  # nothing pays
    a = Acceptance(decay=1.0, first_ok=9, first_n=10, next_ok=1, next_n=10)
    assert next_k(3, a, dear, draft_is_free=False) == 0
    a.observe(1, 1)
    assert a.in_run and next_k(3, a, dear, draft_is_free=False) == 1


def test_calibration_fits_a_tiny_max_model_len(one_thread, llm_cache, tiny_models):
    llm = llm_cache.get(tiny_models["llama"], speculative_model="[ngram]", num_speculative_tokens=8,
                        speculative_adaptive=True, max_model_len=8)
    assert all(max(t) + min(llm.engine.proposer.costs.verify) <= 8 for t in llm.engine.proposer.costs.verify.values())
    plain = llm_cache.get(tiny_models["llama"], max_model_len=8)
    assert gen_ids(llm, [[5, 6]], max_tokens=5, **GREEDY) == gen_ids(plain, [[5, 6]], max_tokens=5, **GREEDY)


def test_lookup_and_draft_model_acceptance_are_kept_apart():
    c = CostModel()
    for _ in range(50):
        c.observe_acceptance(Acceptance(), 4, 0, lookup=True)  # looked-up drafts always fail
        c.observe_acceptance(Acceptance(), 4, 4)                # the draft model's always pass
    assert c.lookup_prior.kind_rates()[0] < 0.05 and c.prior.kind_rates()[0] > 0.95


def _hybrid_run(llm_cache, tiny_models, draft, lookup, monkeypatch, **spec):
    """Adaptive ngram_first with a stand-in for prompt lookup (``lookup(plain outputs)`` gives it), on costs
    where drafting pays whenever drafts are accepted; greedy output must stay plain's. Returns the engine's
    spec stats and the engine-wide first-token rate of looked-up drafts."""
    import specdecode.speculative.ngram as le

    plain = gen_ids(llm_cache.get(tiny_models["llama"]), PROMPTS, max_tokens=24, **GREEDY)
    llm = llm_cache.get(tiny_models["llama"], speculative_model=draft, num_speculative_tokens=3,
                        speculative_adaptive=True, speculative_ngram_first=True, **spec)
    eng = llm.engine
    saved = eng.proposer.costs
    eng.proposer.costs = _costs({1: 0.10, 2: 0.10, 3: 0.10, 4: 0.10}, 0.01)
    monkeypatch.setattr(le, "ngram_lookup", lookup(plain))
    try:
        for p, want in zip(PROMPTS * 2, plain * 2):
            assert gen_ids(llm, [p], max_tokens=24, **GREEDY)[0] == want
        return eng.spec_stats, eng.proposer.costs.lookup_prior.kind_rates()[0]
    finally:
        eng.proposer.costs = saved


def test_hybrid_turns_off_failing_lookups_but_keeps_a_good_draft_model(one_thread, llm_cache, tiny_models,
                                                                        monkeypatch):
    def always_wrong(plain):  # a "match" every step, never right
        bad = next(t for t in range(1, 500) if all(t not in out for out in plain))
        return lambda tokens, k, lo, hi: [bad] * k

    # The target drafting for itself: every draft-model token is accepted.
    s, lookup_rate = _hybrid_run(llm_cache, tiny_models, tiny_models["llama"], always_wrong, monkeypatch)
    # Lookups lose their turn once their own rate is known; the draft model then drafts nearly every step.
    assert lookup_rate < 0.3
    assert s.num_accepted_tokens / s.num_draft_tokens > 0.6


def _oracle(plain):  # a lookup that always finds the target's own continuation
    def find(tokens, k, lo, hi):
        for p, want in zip(PROMPTS, plain):
            if tokens[:len(p)] == p and tokens[len(p):] == want[:len(tokens) - len(p)]:
                return want[len(tokens) - len(p):][:k]
        return []
    return find


def test_hybrid_prefers_lookups_that_beat_the_draft_model(one_thread, llm_cache, tiny_models, noisy_drafts,
                                                          monkeypatch):
    s, lookup_rate = _hybrid_run(llm_cache, tiny_models, noisy_drafts["llama"], _oracle, monkeypatch)
    assert s.num_accepted_tokens == s.num_draft_tokens  # every draft was a (perfect) lookup
    assert lookup_rate > 0.9
    assert len(s.accepted_per_pos) == 3


def test_hybrid_lookups_go_deeper_than_the_draft_model(one_thread, llm_cache, tiny_models, noisy_drafts,
                                                       monkeypatch):
    """prompt_lookup_num_tokens=8 with k=3: calibrated up to 9 rows, and perfect lookups run past 3."""
    s, _ = _hybrid_run(llm_cache, tiny_models, noisy_drafts["llama"], _oracle, monkeypatch,
                       prompt_lookup_num_tokens=8)
    assert s.num_accepted_tokens == s.num_draft_tokens
    assert len(s.accepted_per_pos) > 3 and s.accepted_per_pos[3] > 0
    costs = llm_cache.get(tiny_models["llama"], speculative_model=noisy_drafts["llama"], num_speculative_tokens=3,
                          speculative_adaptive=True, speculative_ngram_first=True,
                          prompt_lookup_num_tokens=8).engine.proposer.costs
    assert all(set(calibration_rows(8)) <= set(t) for t in costs.verify.values())


def test_a_long_context_is_timed_after_a_repeated_prefill_and_its_memory_given_back(one_thread, llm_cache,
                                                                                     tiny_models, tiny_draft):
    """Passes are timed after a short, a middling and a long context: the long one repeats the middling one's
    prefilled keys (KVCache.repeat), for the target and the draft alike, and the engine then has its whole
    cache free and decodes as plain does."""
    from specdecode.speculative.adaptive.calibration import CONTEXTS, _REAL_CONTEXT

    repeats = []
    from specdecode.engine.kv_cache import KVCache
    real = KVCache.repeat

    def spy(self, slot, have, end):
        repeats.append((self.draft, have, end))
        return real(self, slot, have, end)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVCache, "repeat", spy)
        import specdecode.speculative.adaptive.policy as ad
        mp.setattr(ad, "_CALIBRATED", {})
        llm = llm_cache.get(tiny_models["llama"], speculative_model=str(tiny_draft), num_speculative_tokens=3,
                            speculative_adaptive=True, max_model_len=1024)
    costs = llm.engine.proposer.costs
    long = min(CONTEXTS[-1], 1024 - 3 - 2)
    assert sorted(costs.verify) == [32, _REAL_CONTEXT, long] and sorted(costs.draft_rows) == sorted(costs.verify)
    assert sorted(repeats) == [(False, _REAL_CONTEXT, long), (True, _REAL_CONTEXT, long)]
    pool = llm.engine.pool
    assert pool.num_free_blocks == pool.num_blocks
    plain = llm_cache.get(tiny_models["llama"], max_model_len=1024)
    assert gen_ids(llm, PROMPTS, max_tokens=12, **GREEDY) == gen_ids(plain, PROMPTS, max_tokens=12, **GREEDY)


def test_calibration_is_kept_on_disk_and_a_broken_cache_is_rebuilt(one_thread, tiny_models, tmp_path, monkeypatch,
                                                                     caplog):
    """The calibration is timed once per setup and read back by later engine starts (the same numbers, no
    timing); an unreadable cache file is reported in one line and replaced, never used."""
    import json

    import specdecode.speculative.adaptive.cache as cache
    import specdecode.speculative.adaptive.policy as ad
    from specdecode import LLM

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(ad, "_CALIBRATED", {})  # a fresh process
    monkeypatch.setattr(cache, "MAX_OTHER_CPU_SHARE", 1.0)  # kept however busy the test machine is
    timed = []
    real = ad.calibrate
    monkeypatch.setattr(ad, "calibrate", lambda *a, **k: timed.append(1) or real(*a, **k))
    kw = dict(speculative_model="[ngram]", num_speculative_tokens=3, speculative_adaptive=True, max_model_len=128)
    first = LLM(str(tiny_models["llama"]), **kw).engine.proposer.costs
    stored = json.loads((tmp_path / "adaptive_costs.json").read_text())
    assert len(stored) == 1 and timed == [1]
    monkeypatch.setattr(ad, "_CALIBRATED", {})
    again = LLM(str(tiny_models["llama"]), **kw).engine.proposer.costs
    assert timed == [1] and again.verify == first.verify  # read back, not timed again
    (tmp_path / "adaptive_costs.json").write_text('{"truncated": ')
    monkeypatch.setattr(ad, "_CALIBRATED", {})
    with caplog.at_level("WARNING", logger="specdecode"):
        rebuilt = LLM(str(tiny_models["llama"]), **kw).engine.proposer.costs
    assert timed == [1, 1] and sorted(rebuilt.verify) == sorted(first.verify)
    assert any("unreadable speculation cost cache" in r.getMessage() for r in caplog.records)
    assert len(json.loads((tmp_path / "adaptive_costs.json").read_text())) == 1


def test_a_calibration_timed_on_a_busy_machine_is_used_but_not_kept(one_thread, tiny_models, tmp_path, monkeypatch,
                                                                    caplog):
    """Contention skews the stored ratios for every later start, so a calibration during which other
    processes held the CPUs serves this run only: one warning, nothing stored, the next start times again."""
    import specdecode.speculative.adaptive.calibration as calibration
    import specdecode.speculative.adaptive.policy as ad
    from specdecode import LLM

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(ad, "_CALIBRATED", {})
    monkeypatch.setattr(calibration, "other_cpu_share", lambda before, after: 0.6)
    kw = dict(speculative_model="[ngram]", num_speculative_tokens=3, speculative_adaptive=True, max_model_len=128)
    with caplog.at_level("WARNING", logger="specdecode"):
        costs = LLM(str(tiny_models["llama"]), **kw).engine.proposer.costs
    assert costs.verify and costs.other_cpu_share == 0.6
    assert not (tmp_path / "adaptive_costs.json").exists()
    assert any("60% of this process's CPUs" in r.getMessage() for r in caplog.records)


def test_other_cpu_share_sees_a_busy_process():
    """The load reading behind that rule: another process spinning on one of our CPUs is seen."""
    import subprocess
    import sys
    import time

    from specdecode.cpu_share import cpu_times, other_cpu_share

    # Bounded, so that a test run killed before the finally below leaves no process spinning behind it.
    spin = "import time\nend = time.time() + 30\nprint('spinning', flush=True)\nwhile time.time() < end: pass"
    spinner = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    try:
        # Measure only once it spins: on a loaded host its interpreter may take longer than any fixed wait to start.
        assert spinner.stdout.readline().strip() == "spinning"
        before = cpu_times()
        time.sleep(1.0)
        busy = other_cpu_share(before, cpu_times())
    finally:
        spinner.kill()
        spinner.wait()
        spinner.stdout.close()
    cpus = len(os.sched_getaffinity(0))
    assert busy is not None and busy > 0.6 / cpus, busy


# ---- the plan for the whole batch (plan_step / AdaptiveK.plan) ----
def _cpu_like() -> CostModel:
    """Verification nearly flat up to a handful of rows (weight-bandwidth bound), then linear in the rows
    (compute bound), as on a CPU; batched draft steps cost little more than one row."""
    c = CostModel()
    for rows, s in {1: 0.100, 2: 0.102, 3: 0.104, 5: 0.110, 8: 0.130, 16: 0.240, 32: 0.480, 64: 0.960}.items():
        c.add(0, rows, s)
    for rows, s in {1: 0.020, 2: 0.021, 4: 0.023, 8: 0.028, 16: 0.040, 64: 0.160}.items():
        c.add_draft(0, s, rows)
    return c


def _draft_options(p: float, cap: int, once: float = 0.0) -> list[StepOption]:
    return [PLAIN] + [StepOption(False, k, expected_tokens(p, p, k), once) for k in range(1, cap + 1)]


def test_batch_of_one_drafts_and_agrees_with_choose_k():
    c = _cpu_like()
    for p in (0.3, 0.6, 0.9):
        [j] = plan_step([_draft_options(p, 4)], c)
        assert _draft_options(p, 4)[j].k == choose_k(p, p, 4, c, draft_is_free=False)
    [j] = plan_step([_draft_options(0.9, 4)], c)
    assert _draft_options(0.9, 4)[j].k >= 3


def test_a_large_batch_with_dear_verify_rows_turns_speculation_off():
    c = _cpu_like()
    # 16 requests: a plain step is already 16 rows on the linear part of the curve, so every draft row costs
    # about what a token earns, and even well-accepted drafts (0.8) do not pay.
    plan = plan_step([_draft_options(0.8, 4) for _ in range(16)], c)
    assert plan == [0] * 16
    # Lookups cost no draft passes but the same rows: off as well.
    lookups = [[PLAIN] + [StepOption(True, k, expected_tokens(0.8, 0.8, k)) for k in range(1, 9)]] * 16
    assert plan_step(lookups, c) == [0] * 16
    # Two such requests are still on the flat part: both speculate.
    assert all(plan_step(lookups[:2], c)) and all(plan_step([_draft_options(0.8, 4)] * 2, c))


def test_a_lookup_with_per_token_chances_stops_before_its_contested_tokens():
    """Given each looked-up token's chance of acceptance, the plan drafts the confident run and stops before
    a contested token, whatever the request's own average lookup rate says."""
    policy = AdaptiveK(enabled=True, costs=_cpu_like())

    def request():
        return FakeRequest(all_token_ids=list(range(40)), spec=SpecState(), num_output_tokens=10)

    confident = [0.97] * 6 + [0.1] * 6
    [(looked_up, k)] = policy.plan([request()], [100], [12], [0], [confident])
    assert looked_up and k == 6
    [(looked_up, k)] = policy.plan([request()], [100], [12], [0], [[0.97] * 12])
    assert looked_up and k > 6  # past where the other one stopped, to where rows cost more than they earn
    [(_, k)] = policy.plan([request()], [100], [12], [0], [[0.05] * 12])
    assert k <= 1  # nothing pays (at most a probe)
    # Without per-token chances the request's average lookup rates decide: the same depth for both drafts.
    assert policy.plan([request()], [100], [12], [0]) == policy.plan([request()], [100], [12], [0], [None])


def test_requests_draft_together_when_the_draft_pass_is_shared():
    c = CostModel()
    for rows, s in {1: 0.100, 2: 0.101, 5: 0.104, 10: 0.108, 20: 0.116}.items():
        c.add(0, rows, s)
    for rows, s in {1: 0.064, 4: 0.065}.items():  # a draft step of 4 rows costs what one of 1 does
        c.add_draft(0, s, rows)
    opts = [_draft_options(0.7, 4) for _ in range(4)]
    # Alone, 0.7 acceptance does not pay for a draft step of 64% of a target pass ...
    assert plan_step(opts[:1], c) == [0]
    # ... but four requests sharing each draft pass do: all of them draft.
    plan = plan_step(opts, c)
    assert all(j > 0 for j in plan)


def _request(prompt: int, output: int = 0, draft_computed: int = 0):
    """A request after `output` tokens of a `prompt`-token prompt whose draft model has seen `draft_computed`
    tokens and is accepted at 0.8."""
    return FakeRequest(all_token_ids=[1] * (prompt + output), num_output_tokens=output,
                       draft_computed=draft_computed,
                       spec=SpecState(Acceptance(decay=1.0, first_ok=8, first_n=10, next_ok=8, next_n=10)))


def test_one_off_catch_up_work_keeps_short_requests_plain():
    policy = AdaptiveK(enabled=True, costs=_cpu_like())

    # The draft model has not seen this 400-token prompt: its prefill costs what ~10 target steps do. With 8
    # tokens left it cannot pay for itself; with 400 left it does, once the request has decoded for three times
    # the catch-up (33 steps here: _RENT), and a draft already caught up drafts at once.
    assert policy.plan([_request(400)], [7], [0], [4]) == [(False, 0)]
    assert policy.plan([_request(400)], [399], [0], [4]) == [(False, 0)]
    assert policy.plan([_request(400, 25)], [374], [0], [4]) == [(False, 0)]
    assert policy.plan([_request(400, 40)], [359], [0], [4])[0][1] > 0
    assert policy.plan([_request(400, 2, draft_computed=401)], [7], [0], [4])[0][1] > 0


def test_a_step_that_looks_up_warms_up_a_draft_model_worth_starting():
    """A lookup may win a request's first step while starting the draft model would pay too. The draft model
    then catches up in that step (draft_warm_up), or it would owe more every step after and never start."""
    policy = AdaptiveK(enabled=True, costs=_cpu_like())
    sure = [[0.97] * 6]
    r = _request(400, 40)
    [(looked_up, k)] = policy.plan([r], [359], [6], [4], sure)
    assert looked_up and k > 0 and r.spec.draft_warm_up
    r = _request(400)  # 8 tokens left: the catch-up would not pay, so the lookup step does not pay for it either
    [(looked_up, k)] = policy.plan([r], [7], [6], [4], sure)
    assert looked_up and k > 0 and not r.spec.draft_warm_up
    r = _request(400, 2, draft_computed=401)  # nothing to catch up on
    policy.plan([r], [399], [6], [4], sure)
    assert not r.spec.draft_warm_up
    r = _request(400, 40)  # the draft model itself drafts: its catch-up happens anyway
    [(looked_up, k)] = policy.plan([r], [359], [0], [4])
    assert not looked_up and k > 0 and not r.spec.draft_warm_up


def test_text_a_grammar_forces_does_not_repay_a_draft_catch_up():
    """Under a grammar the engine drafts forced text itself, ahead of the proposer (draft_prefix). A draft
    model's catch-up is repaid only on the tokens it drafts: where the grammar forced most of the output so far,
    starting it does not pay; without forced text the same request starts it. Every option also verifies the
    forced tokens, and counts them as emitted."""
    policy = AdaptiveK(enabled=True, costs=_cpu_like())
    free = _request(400, 40)
    assert policy.plan([free], [100], [0], [4])[0][1] > 0
    forced = _request(400, 40)
    forced.num_forced = 35
    assert policy.plan([forced], [100], [0], [4]) == [(False, 0)]
    forced.draft_prefix = [5] * 4
    sc = StepCosts(policy.costs, 416)
    opts = policy._options(forced, False, 4, 100, sc)
    assert all(o.fixed == 4 and o.rows == 5 + o.k for o in opts)
    assert opts[0].tokens == pytest.approx(4 + policy._options(free, False, 1, 100, sc)[0].tokens)


def test_draft_catch_up_waits_until_a_request_outlives_the_short_answers():
    """Where some answers are short, a request does not start the draft model's prefill before it has
    outlived them (the mean length would say every answer runs long); where all run long, it starts at once."""
    def request(output: int):
        return _request(400, output)

    def finished(policy: AdaptiveK, lengths: list[int]) -> None:
        for n in lengths:
            policy.finished(FakeRequest(num_output_tokens=n, spec=SpecState()))

    long_only = AdaptiveK(enabled=True, costs=_cpu_like())
    finished(long_only, [400] * 20)
    assert long_only.plan([request(40)], [500], [0], [4])[0][1] > 0  # as soon as _RENT allows
    mixed = AdaptiveK(enabled=True, costs=_cpu_like())
    finished(mixed, [400, 400, 12, 400, 20, 400, 400, 16, 400, 400] * 2)  # the mean is 285 tokens
    # Each short answer stands for answers up to twice as long: the draft model starts past 2 x 20 tokens.
    assert mixed.assured_left(request(0), 500) <= 20 < mixed.assured_left(request(41), 500)
    assert mixed.plan([request(0)], [500], [0], [4]) == [(False, 0)]
    assert mixed.plan([request(21)], [500], [0], [4]) == [(False, 0)]
    assert mixed.plan([request(41)], [500], [0], [4])[0][1] > 0
    # A request that has just outlived a few short answers (10 and 12 tokens, as in a chat client's warm-up and
    # a one-line answer) among long ones is still likely short itself: no catch-up at 13 tokens. Answers cut by
    # their budget are not spread: they say nothing about answers ending early.
    few_short = AdaptiveK(enabled=True, costs=_cpu_like())
    for n, reason in [(10, "stop")] + [(128, "length")] * 4 + [(12, "stop")] + [(128, "length")] * 4:
        few_short.finished(FakeRequest(num_output_tokens=n, finish_reason=reason, spec=SpecState()))
    assert few_short.assured_left(request(13), 500) <= 12
    assert few_short.plan([request(13)], [115], [0], [4]) == [(False, 0)]
    assert few_short.assured_left(request(36), 92) == 92
    assert few_short.plan([request(36)], [92], [0], [4])[0][1] > 0
    # Nor is a request taken to end sooner than the answers seen: after one 65-token answer, a request at its
    # first token has at least 64 to go (JSON answers of 65 and 128 tokens, say).
    one_answer = AdaptiveK(enabled=True, costs=_cpu_like())
    one_answer.finished(FakeRequest(num_output_tokens=65, finish_reason="stop", spec=SpecState()))
    assert one_answer.assured_left(request(1), 127) >= 64
    # The budget caps what is left: 8 tokens to go cannot pay for the prefill however long answers run.
    assert long_only.assured_left(request(0), 7) == 8
    assert long_only.plan([request(0)], [7], [0], [4]) == [(False, 0)]


def test_no_draft_catch_up_while_the_batch_is_about_to_grow_back():
    """A draft model that has not seen a request's prompt must catch up before it drafts, a one-off that
    pays back over many steps. A lone request does not start that while the batch was recently large enough
    that drafting would not pay there (the others are only being prefilled); a draft already caught up keeps
    drafting, and once the batch stays small the catch-up is worth it again."""
    def req(seen: int):
        return FakeRequest(all_token_ids=[1] * 100, num_output_tokens=10, draft_computed=seen, spec=SpecState())

    assert AdaptiveK(enabled=True, costs=_cpu_like()).plan([req(0)], [50], [0], [4])[0][1] > 0  # alone: drafts
    policy = AdaptiveK(enabled=True, costs=_cpu_like())
    assert all(k == 0 for _, k in policy.plan([req(100) for _ in range(16)], [50] * 16, [0] * 16, [4] * 16))
    assert policy.plan([req(0)], [50], [0], [4])[0][1] == 0      # would need a catch-up: waits
    assert policy.plan([req(100)], [50], [0], [4])[0][1] > 0     # caught up: drafts
    ks = [policy.plan([req(0)], [50], [0], [4])[0][1] for _ in range(200)]
    assert 10 < ks.index(next(k for k in ks if k > 0)) < 200
    # The engine also says how many requests it holds: 15 more being prefilled or waiting keep it waiting.
    fresh = AdaptiveK(enabled=True, costs=_cpu_like())
    fresh.expected_batch = 16
    assert fresh.plan([req(0)], [50], [0], [4])[0][1] == 0


def test_probes_only_where_acceptance_is_what_keeps_speculation_off():
    c = _cpu_like()
    policy = AdaptiveK(enabled=True, costs=c)

    def requests(n: int, rate: float):
        low = Acceptance(decay=1.0, first_ok=rate * 50, first_n=50, next_ok=rate * 50, next_n=50)
        return [FakeRequest(all_token_ids=[1] * 50, num_output_tokens=0, draft_computed=50,
                            spec=SpecState(Acceptance(**low.__dict__)))
                for _ in range(n)]

    alone = requests(1, 0.05)  # rarely accepted: off, but probed now and then
    ks = [policy.plan(alone, [100], [0], [4])[0][1] for _ in range(PROBE_EVERY * 3)]
    assert ks.count(1) == 2 and set(ks) == {0, 1}
    crowd = requests(16, 0.8)  # well accepted, but the batch's rows are too dear: never probed
    for _ in range(PROBE_EVERY * 3):
        assert all(k == 0 for _, k in policy.plan(crowd, [100] * 16, [0] * 16, [4] * 16))
    assert all(r.spec.acceptance.steps_without_spec == 0 for r in crowd)


def test_a_full_cost_cache_drops_entries_of_vanished_models_first(tmp_path, monkeypatch):
    """Calibrations of models whose files are gone (a test's temporary models) are evicted before older
    entries of models still on disk, so a test run does not push out the real models' costs."""
    import json

    import specdecode.speculative.adaptive.cache as ad

    monkeypatch.setattr(ad, "_MAX_CACHED_COSTS", 3)
    monkeypatch.setattr(ad, "MAX_OTHER_CPU_SHARE", 1.0)
    kept, gone = tmp_path / "kept.gguf", tmp_path / "gone.gguf"
    kept.write_bytes(b"x")

    def costs() -> ad.CostModel:
        c = ad.CostModel()
        c.add(32, 1, 0.01)
        return c

    ad.cached_calibration("old-kept", costs, tmp_path, files=[str(kept)])
    for i in range(2):
        ad.cached_calibration(f"gone-{i}", costs, tmp_path, files=[str(gone)])
    ad.cached_calibration("new-kept", costs, tmp_path, files=[str(kept)])
    stored = json.loads((tmp_path / "adaptive_costs.json").read_text())
    assert sorted(stored) == ["gone-1", "new-kept", "old-kept"]  # the older vanished-model entry went first
    ad.cached_calibration("newer-kept", costs, tmp_path, files=[str(kept)])
    stored = json.loads((tmp_path / "adaptive_costs.json").read_text())
    assert sorted(stored) == ["new-kept", "newer-kept", "old-kept"]
    assert stored["old-kept"]["files"] == [str(kept)]


def test_the_targets_confidence_judges_a_draft_model_that_has_not_drafted_yet():
    """A request that has not drafted is judged by what the target's confidence over its latest positions
    predicts (ConfidenceRates, learned from verifications), not by the engine-wide rate of the requests before
    it: after a run of badly accepted answers, text the target is sure of still starts the draft model, and
    text it hesitates over does not."""
    from specdecode.speculative.adaptive import ConfidenceRates

    policy = AdaptiveK(enabled=True, costs=_cpu_like())
    for _ in range(40):  # the requests so far: the draft model's first tokens mostly rejected
        policy.costs.observe_acceptance(Acceptance(), 2, 0)
    for _ in range(200):  # ... where the target hesitated; where it was sure, they were accepted
        policy.confidence.observe(0.45, False)
        policy.confidence.observe(0.995, True)
    assert policy.confidence.rate(0.995) > 0.9 and policy.confidence.rate(0.45) < 0.1

    def request(confidences: list[float]):
        return FakeRequest(all_token_ids=[1] * 460, num_output_tokens=60, draft_computed=0,
                           spec=SpecState(confidence=list(confidences)))

    assert policy.plan([request([])], [400], [0], [4]) == [(False, 0)]  # the engine-wide rate: plain
    assert policy.plan([request([0.995] * 8)], [400], [0], [4])[0][1] > 0
    assert policy.plan([request([0.45] * 8)], [400], [0], [4]) == [(False, 0)]
    # Learned per band, and apart for a step inside a run of accepted drafts; a band nobody observed predicts
    # its own confidence. The prior is the mean over the request's confidences, the engine-wide rate one more.
    fresh = ConfidenceRates()
    assert fresh.rate(0.8) == pytest.approx(0.8) == fresh.rate(0.8, in_run=True)
    for _ in range(50):
        fresh.observe(0.8, False)
        fresh.observe(0.8, True, in_run=True)
    assert fresh.rate(0.8) < 0.2 < 0.8 < fresh.rate(0.8, in_run=True)
    assert fresh.rate(0.95) == pytest.approx(0.95)
    engine = Acceptance(decay=1.0, first_ok=1, first_n=2, next_ok=1, next_n=2)
    first, nxt = engine.kind_rates()
    p = fresh.prior([0.8, 0.95], engine)
    assert p.kind_rates() == (pytest.approx((fresh.rate(0.8) + 0.95 + first) / 3),
                              pytest.approx((fresh.rate(0.8, True) + 0.95 + nxt) / 3))


@contextlib.contextmanager
def _draft_costs_scaled(costs: CostModel, factor: float):
    """The draft model's calibrated step costs times ``factor`` for the block (restored after)."""
    saved = {ctx: dict(rows) for ctx, rows in costs.draft_rows.items()}, dict(costs.draft)
    for ctx, rows in costs.draft_rows.items():
        for n in rows:
            rows[n] *= factor
    for ctx in costs.draft:
        costs.draft[ctx] *= factor
    costs._memo.clear()
    try:
        yield
    finally:
        costs.draft_rows, costs.draft = saved
        costs._memo.clear()


@pytest.mark.parametrize("draft_cost", [0.05, 50.0])
def test_the_engine_notes_the_targets_confidence_for_a_draft_model(one_thread, llm_cache, tiny_models, tiny_draft,
                                                                   draft_cost):
    """With adaptive k and a draft model that can pay (its steps made cheap here), each request keeps the
    target's top probability at its latest steps' first positions, and the verifications teach the policy's
    confidence bands. Where the draft model cannot pay at the batch even at the best acceptance the policy could
    expect (its steps made dear), the plan leaves it out and no confidence is computed. Greedy output is
    unchanged either way."""
    plain = gen_ids(llm_cache.get(tiny_models["llama"]), PROMPTS[:2], max_tokens=16, **GREEDY)
    llm = llm_cache.get(tiny_models["llama"], speculative_model=tiny_draft, num_speculative_tokens=3,
                        speculative_adaptive=True)
    seen, hopeless = [], []
    eng = llm.engine
    policy = eng.proposer.policy
    orig = eng.proposer.observe

    def observe(request, drafted, accepted, emitted):
        seen.append(list(request.spec.confidence))
        hopeless.append(policy.drafting_hopeless)
        return orig(request, drafted, accepted, emitted)

    eng.proposer.observe = observe
    learned = sum(n for _, n in policy.confidence.counts.values())
    try:
        with _draft_costs_scaled(policy.costs, draft_cost):
            assert gen_ids(llm, PROMPTS[:2], max_tokens=16, **GREEDY) == plain
    finally:
        del eng.proposer.observe
    assert seen
    if draft_cost > 1:
        assert all(hopeless) and all(not c for c in seen)
        assert sum(n for _, n in policy.confidence.counts.values()) == learned
        return
    assert not any(hopeless[:8])
    assert all(0 < len(c) <= 8 and all(0.0 <= x <= 1.0 for x in c) for c in seen)
    assert max(len(c) for c in seen) == 8
    assert sum(n for _, n in policy.confidence.counts.values()) > learned
