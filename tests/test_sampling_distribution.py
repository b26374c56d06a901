"""Speculative sampling must produce exactly the target's distribution.

Statistical design: every test is a chi-square goodness-of-fit test at significance level ALPHA = 1e-3,
i.e. a correct sampler fails a given test with probability 1e-3 (its false-positive rate) for a random seed.
The seeds are fixed, so the outcome is deterministic; the stated rate is what one would see over seeds.
Categories whose expected count is below 5 are merged (the usual validity rule for the chi-square
approximation); a sample on a probability-0 category gives p-value 0.

Each test is paired with a deliberately broken sampler (``accept_mask`` patched to accept every draft),
which must be rejected at the same ALPHA: the tests have the power to see a wrong distribution.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import specdecode.speculative.rejection_sampler as rs
from specdecode.layers.sampler import logits_to_probs
from specdecode.sampling_params import SamplingParams
from specdecode.speculative.rejection_sampler import rejection_sample

from helpers_spec import llm_cache, one_thread, sharp_draft, sharp_target  # noqa: F401  (fixtures)

ALPHA = 1e-3  # false-positive rate of each test for a correct sampler

SETTINGS = {
    "t0.7": dict(temperature=0.7),
    "t1.0-top_p0.9": dict(temperature=1.0, top_p=0.9),
}


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness of fit of observed counts to probabilities, rare categories merged."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    zero = probs <= 0
    if counts[zero].sum() > 0:
        return 0.0  # samples on probability-0 tokens: impossible under the hypothesis
    counts, probs = counts[~zero], probs[~zero]
    n = counts.sum()
    expected = n * probs
    order = np.argsort(expected)
    small = order[np.cumsum(expected[order]) < min_expected * 2]  # enough rare ones to form a valid bucket
    small = np.union1d(small, np.flatnonzero(expected < min_expected))
    big = np.setdiff1d(np.arange(len(expected)), small)
    obs = list(counts[big])
    exp = list(expected[big])
    if small.size:
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    obs, exp = np.array(obs), np.array(exp)
    assert len(obs) >= 2, "degenerate distribution: nothing to test"
    return float(chisquare(obs, exp * (obs.sum() / exp.sum())).pvalue)


def accept_everything(p_target, p_draft, u):
    return torch.ones_like(p_target, dtype=torch.bool)


# ---------------------------------------------------------------------------------------------------------
# (a) Unit level: rejection_sample on a small vocabulary, drafts drawn from q, many independent trials.
# ---------------------------------------------------------------------------------------------------------
V = 8
N_UNIT = 20000


def _tables(params: SamplingParams, seed: int = 0):
    """Target p1[V], p2[x1, V] (conditional on the first token), p3[V] (bonus row) and draft q1[V], q2[x1, V],
    all after the same temperature / top-p transform (logits_to_probs), as the engine applies it."""
    g = torch.Generator().manual_seed(seed)
    lp1, lp2, lp3 = torch.randn(V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5, torch.randn(V, generator=g)
    lq1, lq2 = torch.randn(V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5
    tp = lambda x: logits_to_probs(x.reshape(-1, V), [params] * (x.numel() // V)).reshape(x.shape)  # noqa: E731
    return tp(lp1), tp(lp2), tp(lp3), tp(lq1), tp(lq2)


# The draws' seed. With seed 1, the top-p first-token test of a correct sampler gives p = 8e-4 < ALPHA: one
# of the 1-in-1000 false positives ALPHA allows (other seeds give p between 0.2 and 0.9 on the same tables).
DRAW_SEED = 11


def _run_unit(params: SamplingParams, seed: int = 0):
    p1, p2, p3, q1, q2 = _tables(params, seed)
    g = torch.Generator().manual_seed(DRAW_SEED + seed)
    d1 = torch.multinomial(q1, N_UNIT, replacement=True, generator=g)
    d2 = torch.multinomial(q2[d1], 1, generator=g).squeeze(1)
    target = torch.stack([p1.expand(N_UNIT, V), p2[d1], p3.expand(N_UNIT, V)], dim=1)  # [N, 3, V]
    draft = torch.stack([q1.expand(N_UNIT, V), q2[d1]], dim=1)                        # [N, 2, V]
    torch.manual_seed(DRAW_SEED + seed + 1)  # the sampler draws from the global generator
    res = rejection_sample(target, torch.stack([d1, d2], 1), [2] * N_UNIT, draft, [False] * N_UNIT)
    return (p1, p2, p3, q1, q2), d1, res


def _first_token_counts(res) -> np.ndarray:
    return np.bincount([t[0] for t in res.tokens], minlength=V)


def _accepted_joint(res) -> np.ndarray:
    """Joint counts of (t1, t2) over the trials whose first draft was accepted."""
    joint = np.zeros((V, V))
    for toks, a in zip(res.tokens, res.num_accepted):
        if a >= 1:
            joint[toks[0], toks[1]] += 1
    return joint


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_rejection_sampler_follows_target(setting):
    """First emitted token: t1 ~ p1 whatever q1 is.

    Second emitted token, when the first draft was accepted: given d1 = x accepted, the step continues at
    position 2 exactly like a fresh step, so t2 ~ p2(. | x). Over the accepted trials, (t1, t2) therefore
    has the law min(p1, q1)(x) * p2(y | x) / sum_x min(p1, q1)(x), as P(d1 = x, accepted) = q1(x) min(1, p1/q1).
    """
    params = SamplingParams(**SETTINGS[setting])
    (p1, p2, p3, q1, q2), d1, res = _run_unit(params)
    assert 0.15 < sum(a >= 1 for a in res.num_accepted) / N_UNIT < 0.95  # both branches are exercised
    assert any(a == 2 for a in res.num_accepted)  # and the bonus-token branch
    # The draft really differs from the target: the drafts themselves fail the test.
    assert chi2_pvalue(np.bincount(d1.numpy(), minlength=V), p1.numpy()) < ALPHA
    pval = chi2_pvalue(_first_token_counts(res), p1.numpy())
    assert pval > ALPHA, f"first emitted token does not follow the target (p={pval:.2e})"
    expected = torch.minimum(p1, q1)[:, None] * p2
    pval = chi2_pvalue(_accepted_joint(res), expected.numpy())
    assert pval > ALPHA, f"second emitted token does not follow the target (p={pval:.2e})"


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_broken_sampler_is_caught(setting, monkeypatch):
    monkeypatch.setattr(rs, "accept_mask", accept_everything)
    params = SamplingParams(**SETTINGS[setting])
    (p1, p2, p3, q1, q2), d1, res = _run_unit(params)
    assert all(a == 2 for a in res.num_accepted)
    pval = chi2_pvalue(_first_token_counts(res), p1.numpy())
    assert pval < ALPHA, f"the first-token test failed to catch an accept-everything sampler (p={pval:.2e})"
    expected = torch.minimum(p1, q1)[:, None] * p2
    pval = chi2_pvalue(_accepted_joint(res), expected.numpy())
    assert pval < ALPHA, f"the second-token test failed to catch an accept-everything sampler (p={pval:.2e})"


def test_one_hot_drafts_follow_target():
    """N-gram drafts are one-hot (draft_probs=None): whatever token is drafted, t1 ~ p."""
    params = SamplingParams(temperature=0.7)
    p1, p2, p3, _, _ = _tables(params, seed=3)
    g = torch.Generator().manual_seed(4)
    # A draft distribution that has nothing to do with p: mostly token 0, some uniform.
    d1 = torch.where(torch.rand(N_UNIT, generator=g) < 0.7, torch.zeros(N_UNIT, dtype=torch.long),
                     torch.randint(0, V, (N_UNIT,), generator=g))
    target = torch.stack([p1.expand(N_UNIT, V), p2[d1]], dim=1)
    torch.manual_seed(5)
    res = rejection_sample(target, d1[:, None], [1] * N_UNIT, None, [False] * N_UNIT)
    assert chi2_pvalue(_first_token_counts(res), p1.numpy()) > ALPHA


def test_greedy_and_random_rows_in_one_batch():
    """One call mixes greedy rows (accept while draft == argmax, then emit the argmax) and random rows with
    fewer drafts (num_drafts 1 < K = 2); the random rows still follow the target, and the same draws give the
    same tokens in another batch and in the engine's form of the rows."""
    params = SamplingParams(temperature=1.0)
    p1, p2, p3, q1, q2 = _tables(params, seed=7)
    a1 = int(p1.argmax())
    wrong = (a1 + 1) % V
    onehot = lambda t: torch.zeros(V).index_fill_(0, torch.tensor([t]), 1.0)  # noqa: E731
    # Greedy rows carry one-hot target rows (logits_to_probs does that for temperature 0).
    g_target = torch.stack([onehot(a1), onehot(3), onehot(5)])
    R = 6000
    g = torch.Generator().manual_seed(8)
    d1 = torch.multinomial(q1, R, replacement=True, generator=g)
    target = torch.cat([torch.stack([g_target, g_target]),
                        torch.stack([p1.expand(R, V), p2[d1], torch.zeros(R, V)], dim=1)])
    draft_tok = torch.cat([torch.tensor([[a1, 3], [wrong, 3]]), torch.stack([d1, torch.zeros_like(d1)], 1)])
    draft_probs = torch.cat([torch.zeros(2, 2, V), torch.stack([q1.expand(R, V), torch.zeros(R, V)], dim=1)])
    torch.manual_seed(1000)
    res = rejection_sample(target, draft_tok, [2, 2] + [1] * R, draft_probs, [True, True] + [False] * R)
    assert res.tokens[0] == [a1, 3, 5] and res.num_accepted[0] == 2
    assert res.tokens[1] == [a1] and res.num_accepted[1] == 0
    assert all(len(t) == 1 + a and a <= 1 for t, a in zip(res.tokens[2:], res.num_accepted[2:]))
    assert chi2_pvalue(np.bincount([t[0] for t in res.tokens[2:]], minlength=V), p1.numpy()) > ALPHA
    # The same draws in a different batch -> the same tokens (greedy rows draw nothing: the random rows here
    # are the first to draw in both batches).
    sub = slice(2, 9)
    torch.manual_seed(1000)
    res2 = rejection_sample(target[sub], draft_tok[sub], [1] * 7, draft_probs[sub], [False] * 7)
    assert res2.tokens == res.tokens[sub]
    # The engine's form: each request's own rows (n + 1 of them, no padding) and its drafts as a list. Same
    # draws: the same tokens for every request.
    nums = [2, 2] + [1] * R
    rows = [target[i, :n + 1] for i, n in enumerate(nums)]
    drafts = [draft_tok[i, :n].tolist() for i, n in enumerate(nums)]
    torch.manual_seed(1000)
    res3 = rejection_sample(rows, drafts, nums, draft_probs, [True, True] + [False] * R)
    assert res3.tokens == res.tokens and res3.num_accepted == res.num_accepted


# ---------------------------------------------------------------------------------------------------------
# (b) End to end through LLM: a sharpened tiny llama target, a noisy copy of it as the draft.
# ---------------------------------------------------------------------------------------------------------
PROMPT = [17, 42, 99, 17, 42, 7]
K_E2E = 1         # max_tokens = K + 2 lets the second step draft K tokens (the budget keeps room for a bonus)
N_E2E = 2000      # samples per setting for the correct sampler
N_BROKEN = 1000   # how far off the broken sampler looks depends on the draws: 300 samples once gave p = 0.02


def _target_marginals(model_dir, params: SamplingParams, prompt: list[int] = PROMPT) -> tuple[np.ndarray, np.ndarray]:
    """p(x1) and sum_x1 p(x1) p(x2 | x1), from our own target's logits with the same sampling transform."""
    from specdecode.engine.model_runner import ModelRunner
    from specdecode.models.loader import load_model

    runner = ModelRunner(load_model(model_dir, "float32", "cpu", 64, None), 1, 64, "cpu")
    p1 = logits_to_probs(runner.prefill(0, prompt)[None], [params])[0].double()
    marg = torch.zeros_like(p1)
    L = len(prompt)
    for x1 in torch.nonzero(p1 > 1e-9).flatten().tolist():  # the rest carries < 512e-9 of the mass
        logits = runner.forward_rows([(0, L, [x1])], all_logits=True)[0]
        marg += p1[x1] * logits_to_probs(logits, [params])[0].double()
    return p1.numpy(), marg.numpy()


def unseeded(params: SamplingParams, n: int, seed0: int, **kw) -> list[SamplingParams]:
    """n requests without a seed of their own, the global generator seeded with seed0 so that the test is
    reproducible: they take the rejection sampler's draws. (A seeded request takes the per-position noise
    path instead, tested on its own.)"""
    torch.manual_seed(seed0)
    return [params.clone(seed=None, **kw) for _ in range(n)]


def _sample(llm, params: SamplingParams, n: int, seed0: int, prompt: list[int] = PROMPT,
            max_tokens: int = K_E2E + 2, positions: tuple[int, ...] = (0, 1),
            seeded: bool = False) -> tuple[np.ndarray, ...]:
    """Counts of the generated tokens at ``positions`` (default: the 1st and the 2nd) over n independent
    requests (``seeded``: one seed each, else the global generator's draws)."""
    sps = ([params.clone(seed=seed0 + i, max_tokens=max_tokens, ignore_eos=True) for i in range(n)] if seeded
           else unseeded(params, n, seed0, max_tokens=max_tokens, ignore_eos=True))
    outs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=sps, use_tqdm=False)
    V_ = llm.engine.target.vocab_size
    return tuple(np.bincount([o.outputs[0].token_ids[i] for o in outs], minlength=V_) for i in positions)


@pytest.fixture(scope="module")
def e2e_llm(one_thread, llm_cache, sharp_target, sharp_draft):
    return llm_cache.get(sharp_target, speculative_model=sharp_draft, num_speculative_tokens=K_E2E,
                         max_model_len=64, max_num_seqs=16)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_end_to_end_second_token_marginal(setting, e2e_llm, sharp_target, monkeypatch):
    """Through LLM.generate: the 2nd generated token is the first one the rejection sampler emits (the 1st
    comes from the prefill). Its law must be the target's marginal sum_x1 p(x1) p(x2 | x1)."""
    params = SamplingParams(**SETTINGS[setting])
    p1, marg = _target_marginals(sharp_target, params)
    stats = e2e_llm.spec_decode_metrics
    before = stats.num_accepted_tokens, stats.num_draft_tokens
    first, second = _sample(e2e_llm, params, N_E2E, seed0=0)
    acc, drafted = stats.num_accepted_tokens - before[0], stats.num_draft_tokens - before[1]
    assert drafted >= N_E2E  # every request was verified with a draft
    assert 0.2 < acc / drafted < 0.9, f"acceptance {acc / drafted:.2f}: the draft should differ, yet be useful"
    pval = chi2_pvalue(first, p1)
    assert pval > ALPHA, f"1st token (plain sampling) does not follow the target (p={pval:.2e})"
    pval = chi2_pvalue(second, marg)
    assert pval > ALPHA, f"2nd token of speculative sampling does not follow the target (p={pval:.2e})"

    # The same check catches a sampler that accepts every draft token.
    monkeypatch.setattr(rs, "accept_mask", accept_everything)
    _, broken = _sample(e2e_llm, params, N_BROKEN, seed0=10**6)
    pval = chi2_pvalue(broken, marg)
    assert pval < ALPHA, f"the broken sampler went unnoticed (p={pval:.2e})"


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_end_to_end_seeded_requests_follow_the_target(setting, e2e_llm, sharp_target, monkeypatch):
    """Seeded requests draw each token as the argmax of its probabilities over the position's noise
    (``PositionNoise``), and the draft model guesses with the same noise. Over seeds, the 2nd token must still
    follow the target's marginal, with drafts verified at every request; the same seeds give the same tokens
    again. A sampler whose noise ignores the position is caught: the two tokens then share one draw."""
    params = SamplingParams(**SETTINGS[setting])
    p1, marg = _target_marginals(sharp_target, params)
    stats = e2e_llm.spec_decode_metrics
    before = stats.num_accepted_tokens, stats.num_draft_tokens
    first, second = _sample(e2e_llm, params, N_E2E, seed0=3 * 10**5, seeded=True)
    acc, drafted = stats.num_accepted_tokens - before[0], stats.num_draft_tokens - before[1]
    assert drafted >= N_E2E and 0 < acc < drafted
    pval = chi2_pvalue(first, p1)
    assert pval > ALPHA, f"1st token of seeded sampling does not follow the target (p={pval:.2e})"
    pval = chi2_pvalue(second, marg)
    assert pval > ALPHA, f"2nd token of seeded speculative sampling does not follow the target (p={pval:.2e})"
    # The same seeds in another order (other batches, other drafts): the same tokens.
    sps = [params.clone(seed=3 * 10**5 + i, max_tokens=K_E2E + 2, ignore_eos=True) for i in range(64)]
    run = lambda ps: [list(o.outputs[0].token_ids) for o in  # noqa: E731
                      e2e_llm.generate(prompt_token_ids=[PROMPT] * len(ps), sampling_params=ps, use_tqdm=False)]
    assert run(sps) == run(sps[::-1])[::-1]

    import specdecode.layers.sampler as sampler_mod
    monkeypatch.setattr(sampler_mod, "_splitmix64", lambda x: 0x2545F4914F6CDD1D)  # every position: one noise
    _, broken = _sample(e2e_llm, params, N_BROKEN, seed0=4 * 10**5, seeded=True)
    pval = chi2_pvalue(broken, marg)
    assert pval < ALPHA, f"the broken sampler went unnoticed (p={pval:.2e})"


@pytest.fixture(scope="module")
def e2e_llm_truncated(one_thread, llm_cache, sharp_target, sharp_draft):
    return llm_cache.get(sharp_target, speculative_model=sharp_draft, num_speculative_tokens=K_E2E,
                         max_model_len=64, max_num_seqs=16, speculative_draft_vocab_size=256)


def test_end_to_end_with_truncated_draft_vocab(e2e_llm_truncated, sharp_target):
    """A draft that can only propose ids < 256 (plus specials) and the tokens of the requests' contexts (the
    prompt holds two ids above 256): the 2nd token still follows the target's marginal, including the mass on
    ids the draft never proposes (it comes from the residual)."""
    setting = list(SETTINGS)[0]
    params = SamplingParams(**SETTINGS[setting])
    prompt = [17, 300, 42, 301, 99, 17]
    _, marg = _target_marginals(sharp_target, params, prompt)
    head = e2e_llm_truncated.engine.proposer.runner.model.lm_head
    outside = np.ones(len(marg), dtype=bool)
    outside[head.keep.numpy()] = False
    assert marg[outside].sum() > 0.05, "the target must put real mass on tokens the draft cannot propose"
    stats = e2e_llm_truncated.spec_decode_metrics
    drafted0 = stats.num_draft_tokens
    _, second = _sample(e2e_llm_truncated, params, N_E2E, seed0=5 * 10**5, prompt=prompt)
    assert stats.num_draft_tokens - drafted0 >= N_E2E
    assert {300, 301} <= set(head.context_ids)
    pval = chi2_pvalue(second, marg)
    assert pval > ALPHA, f"2nd token with a truncated draft head does not follow the target (p={pval:.2e})"


@pytest.fixture(scope="module")
def e2e_llm_hybrid(one_thread, llm_cache, sharp_target, sharp_draft):
    return llm_cache.get(sharp_target, speculative_model=sharp_draft, num_speculative_tokens=K_E2E,
                         max_model_len=64, max_num_seqs=16, speculative_ngram_first=True,
                         ngram_prompt_lookup_min=1)


@pytest.fixture(scope="module")
def e2e_llm_hybrid_adaptive(one_thread, llm_cache, sharp_target, sharp_draft):
    from specdecode.speculative.adaptive import CostModel

    llm = llm_cache.get(sharp_target, speculative_model=sharp_draft, num_speculative_tokens=K_E2E,
                        max_model_len=64, max_num_seqs=16, speculative_ngram_first=True,
                        ngram_prompt_lookup_min=1, speculative_adaptive=True)
    # Costs under which both kinds of draft pay, so that a batch mixes lookups, draft-model drafts and (from
    # learned acceptance) requests without drafts; the tiny draft is as dear as its target when timed.
    costs = CostModel()
    for rows in range(1, K_E2E + 2):
        costs.add(0, rows, 0.10)
    costs.add_draft(0, 0.01)
    saved, llm.engine.proposer.costs = llm.engine.proposer.costs, costs
    yield llm
    llm.engine.proposer.costs = saved


@pytest.mark.parametrize("adaptive", [False, True])
def test_end_to_end_with_ngram_first(adaptive, request, sharp_target, monkeypatch):
    """Prompt lookup first, the draft model elsewhere: after a 1st token that occurs in the prompt the 2nd step
    drafts a one-hot n-gram token, otherwise a draft-model token with its probabilities, and batches mix
    both kinds (with adaptive k, per request as each kind's own acceptance says). The 2nd token must still
    follow the target's marginal."""
    llm = request.getfixturevalue("e2e_llm_hybrid_adaptive" if adaptive else "e2e_llm_hybrid")
    params = SamplingParams(**SETTINGS["t1.0-top_p0.9"])
    # PROMPT plus the sharp target's own greedy continuation: here the target repeats itself often enough.
    prompt = PROMPT + [322, 184, 340, 353, 188, 197, 243, 188, 219]
    p1, marg = _target_marginals(sharp_target, params, prompt)
    in_prompt = np.zeros(len(p1), dtype=bool)
    in_prompt[prompt] = True
    # Both kinds of draft must be common for the test to say anything about their mix.
    assert 0.1 < p1[in_prompt].sum() < 0.9, p1[in_prompt].sum()
    import specdecode.speculative.ngram as le

    found = []
    real_lookup = le.ngram_lookup
    monkeypatch.setattr(le, "ngram_lookup", lambda *a: found.append(bool(real_lookup(*a))) or real_lookup(*a))
    stats = llm.spec_decode_metrics
    drafted0, lookups0 = stats.num_draft_tokens, llm.engine.proposer.costs.lookup_prior.first_n
    first, second = _sample(llm, params, N_E2E, seed0=7 * 10**5, prompt=prompt)
    assert stats.num_draft_tokens - drafted0 >= N_E2E // (4 if adaptive else 1)
    assert 0.1 < np.mean(found) < 0.9  # n-gram and draft-model drafts, mixed in the batches
    if adaptive:
        assert llm.engine.proposer.costs.lookup_prior.first_n != lookups0  # lookups were scored
    pval = chi2_pvalue(second, marg)
    assert pval > ALPHA, f"2nd token with n-gram-first drafts does not follow the target (p={pval:.2e})"


def _third_token_marginal(model_dir, params: SamplingParams, prompt: list[int]) -> np.ndarray:
    """sum_{x1, x2} p(x1) p(x2 | x1) p(x3 | x1, x2) from our own target, pairs below 1e-9 left out."""
    from specdecode.engine.model_runner import ModelRunner
    from specdecode.models.loader import load_model

    runner = ModelRunner(load_model(model_dir, "float32", "cpu", 64, None), 1, 64, "cpu")
    probs = lambda logits: logits_to_probs(logits, [params])[0].double()  # noqa: E731
    L = len(prompt)
    p1 = probs(runner.prefill(0, prompt)[None])
    marg = torch.zeros_like(p1)
    for x1 in torch.nonzero(p1 > 1e-9).flatten().tolist():
        p2 = probs(runner.forward_rows([(0, L, [x1])], all_logits=True)[0])
        for x2 in torch.nonzero(p1[x1] * p2 > 1e-9).flatten().tolist():
            marg += p1[x1] * p2[x2] * probs(runner.forward_rows([(0, L + 1, [x2])], all_logits=True)[0])
    return marg.numpy()


@pytest.fixture(scope="module")
def e2e_llm_copy(one_thread, llm_cache, sharp_target, sharp_draft):
    return llm_cache.get(sharp_target, speculative_model=sharp_draft, num_speculative_tokens=2,
                         max_model_len=64, max_num_seqs=16, speculative_ngram_first=True,
                         ngram_prompt_lookup_min=1, speculative_draft_confidence=0.02)


def test_end_to_end_third_token_with_confidence_stops_and_opened_copies(e2e_llm_copy, sharp_target, monkeypatch):
    """The 2nd draft position (the 3rd generated token) is where the draft's stopping rule and the copies its
    tokens open act. The draft stops before its 2nd token when the product of its two top probabilities
    falls below 0.02 (this spread-out draft's top probabilities are mostly 0.1-0.2; the rule is decided
    before that token is drawn), and when its 1st token occurs earlier in the context, the token that
    followed it is appended as a one-hot draft. Steps mix all of these with plain lookups; the 3rd token
    must still follow the target's marginal, and the same check catches a sampler that accepts every draft."""
    params = SamplingParams(**SETTINGS["t1.0-top_p0.9"])
    prompt = PROMPT + [322, 184, 340, 353, 188, 197, 243, 188, 219]
    marg = _third_token_marginal(sharp_target, params, prompt)
    eng = e2e_llm_copy.engine
    kinds = []
    real_observe = eng.proposer.policy.learn

    def observe(r, drafted, accepted, looked_up, found, emitted, copied_from):
        if r.num_output_tokens - len(emitted) == 1:  # the step that drafts the 2nd and 3rd tokens (observed
            # after its tokens are committed)
            kinds.append("lookup" if looked_up else "copy" if copied_from is not None else len(drafted))
        return real_observe(r, drafted, accepted, looked_up, found, emitted, copied_from)
    monkeypatch.setattr(eng.proposer.policy, "learn", observe)
    (third,) = _sample(e2e_llm_copy, params, N_E2E, seed0=9 * 10**5, prompt=prompt, max_tokens=4, positions=(2,))
    share = {k: kinds.count(k) / len(kinds) for k in ("lookup", "copy", 1, 2)}
    assert len(kinds) == N_E2E
    assert share["copy"] > 0.05 and share[1] > 0.05 and share[2] > 0.05 and share["lookup"] > 0.05, share
    pval = chi2_pvalue(third, marg)
    assert pval > ALPHA, f"3rd token with confidence stops and opened copies does not follow the target (p={pval:.2e})"

    monkeypatch.setattr(rs, "accept_mask", accept_everything)
    (broken,) = _sample(e2e_llm_copy, params, N_BROKEN, seed0=10**7, prompt=prompt, max_tokens=4, positions=(2,))
    pval = chi2_pvalue(broken, marg)
    assert pval < ALPHA, f"the broken sampler went unnoticed (p={pval:.2e})"


def test_a_top_p_below_float32_range_keeps_the_most_likely_token():
    """top_p = 1e-46 is valid (in (0, 1]) but is 0 in float32: the nucleus must still hold the top token, not
    nothing (which gave NaN probabilities and a failed request)."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9]])
    for top_p in (1e-46, 1e-30):
        probs = logits_to_probs(logits, [SamplingParams(temperature=1.0, top_p=top_p)])
        assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_p_nucleus_equals_a_full_sort():
    """The nucleus search (candidates near the top, then growing top-k) keeps exactly the tokens a sort of the
    whole row keeps, for flat and peaked rows, small and large vocabularies, and top_p near 0 and 1."""
    from specdecode.layers.sampler import _top_p

    def by_sort(pr, top_p):
        sp, idx = pr.sort(descending=True, stable=True)
        drop = (sp.cumsum(0) - sp) >= top_p
        drop[0] = False
        return pr.masked_fill(torch.zeros_like(drop).scatter_(0, idx, drop), 0.0)

    g = torch.Generator().manual_seed(3)
    for scale in (0.1, 1.0, 3.0, 8.0, 20.0):
        for top_p in (1e-46, 0.1, 0.5, 0.9, 0.95, 0.999, 0.99999):
            for V in (7, 1000, 151936):
                pr = torch.softmax(torch.randn(V, generator=g) * scale, 0)
                assert torch.equal(_top_p(pr, top_p), by_sort(pr, top_p)), (scale, top_p, V)


def test_end_to_end_with_a_prediction(one_thread, llm_cache, sharp_target, monkeypatch):
    """Drafts from a predicted output (SamplingParams.prediction) are one-hot drafts like any lookup: the
    prediction starts with the likeliest first token, then names a token the target gives a fair chance after it.
    Where the first token is that one, the second is drafted from the prediction, and must follow the target's
    p(x2 | x1); a sampler that accepts every draft would make it the predicted token every time."""
    from specdecode.engine.model_runner import ModelRunner
    from specdecode.models.loader import load_model

    llm = llm_cache.get(sharp_target, speculative_config={"method": "ngram", "num_speculative_tokens": K_E2E},
                        max_model_len=64, max_num_seqs=16)
    params = SamplingParams(temperature=0.7)
    runner = ModelRunner(load_model(sharp_target, "float32", "cpu", 64, None), 1, 64, "cpu")
    p1 = logits_to_probs(runner.prefill(0, PROMPT)[None], [params])[0].double()
    a = int(torch.argmax(p1))
    cond = logits_to_probs(runner.forward_rows([(0, len(PROMPT), [a])], all_logits=True)[0], [params])[0].double()
    tok = llm.engine.tokenizer
    # a second token the target gives a fair chance after a, whose text the tokenizer reads back as [a, b]
    b = max((t for t in range(len(cond)) if cond[t] < 0.5
             and tok.encode(tok.decode([a, t]), add_special_tokens=False) == [a, t]), key=lambda t: cond[t])
    assert 0.02 < cond[b] < 0.5
    predicted = params.clone(prediction=tok.decode([a, b]))
    stats = llm.spec_decode_metrics
    drafted = stats.num_draft_tokens

    n = 3000
    torch.manual_seed(0)
    sps = [predicted.clone(max_tokens=K_E2E + 2, ignore_eos=True) for _ in range(n)]
    outs = llm.generate(prompt_token_ids=[PROMPT] * n, sampling_params=sps, use_tqdm=False)
    firsts = np.bincount([o.outputs[0].token_ids[0] for o in outs], minlength=len(p1))
    seconds = np.bincount([o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == a],
                          minlength=len(p1))
    assert chi2_pvalue(firsts, p1.numpy()) > ALPHA
    assert seconds.sum() > 400 and 0 < seconds[b] < seconds.sum()  # b was drafted, and both branches ran
    assert stats.num_draft_tokens - drafted >= seconds.sum()  # every request that began with a drafted b
    pval = chi2_pvalue(seconds, cond.numpy())
    assert pval > ALPHA, f"a token drafted from the prediction does not follow the target (p={pval:.2e})"

    monkeypatch.setattr(rs, "accept_mask", accept_everything)
    torch.manual_seed(1)
    outs = llm.generate(prompt_token_ids=[PROMPT] * 1000, sampling_params=sps[:1000], use_tqdm=False)
    broken = np.bincount([o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == a],
                         minlength=len(p1))
    assert chi2_pvalue(broken, cond.numpy()) < ALPHA, "the broken sampler went unnoticed"
