"""Greedy speculative decoding must return exactly plain greedy decoding's token ids.

Every native family, k in {1, 2, 4, 8}, both proposers, batch sizes 1 and 4 with prompts of different
lengths. The draft model is a noisy copy of the target (accepted partly, so rejections and KV rollbacks
happen at many positions); the n-gram proposer gets a repetitive prompt. A self-draft accepts 100%.
Per-request and aggregate speculation metrics must add up.
"""
from __future__ import annotations

import pytest

from specdecode import LLM, SamplingParams

from helpers_spec import (GREEDY, PROMPTS, gen_ids, llm_cache, noisy_drafts,  # noqa: F401  (fixtures)
                          one_thread)

FAMILIES = ("llama", "qwen2", "qwen3", "opt", "gpt2")
KS = (1, 2, 4, 8)
MAX_TOKENS = 24


def _generate(llm, prompts, **params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(**params), use_tqdm=False)


@pytest.fixture(scope="module")
def plain(one_thread, llm_cache, tiny_models):
    """family -> (batched greedy ids for PROMPTS, the same prompts run one by one)."""
    memo = {}

    def get(fam):
        if fam not in memo:
            llm = llm_cache.get(tiny_models[fam])
            batched = gen_ids(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
            single = [gen_ids(llm, [p], max_tokens=MAX_TOKENS, **GREEDY)[0] for p in PROMPTS]
            memo[fam] = batched, single
        return memo[fam]

    return get


@pytest.mark.parametrize("fam", FAMILIES)
def test_plain_batched_equals_one_by_one(fam, plain):
    batched, single = plain(fam)
    assert all(len(ids) == MAX_TOKENS for ids in batched)
    assert batched == single
    assert len({tuple(ids) for ids in batched}) == len(PROMPTS)  # the prompts really lead to different outputs


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("proposer", ["draft", "ngram"])
@pytest.mark.parametrize("fam", FAMILIES)
def test_speculative_greedy_equals_plain(fam, proposer, k, plain, llm_cache, tiny_models, noisy_drafts):
    batched, single = plain(fam)
    spec_model = noisy_drafts[fam] if proposer == "draft" else "[ngram]"
    llm = llm_cache.get(tiny_models[fam], speculative_model=spec_model, num_speculative_tokens=k)

    outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)  # batch of 4, lengths 11, 1, 20, 7
    assert [list(o.outputs[0].token_ids) for o in outs] == batched
    i = k % len(PROMPTS)  # batch of 1: a different prompt for each k
    assert gen_ids(llm, [PROMPTS[i]], max_tokens=MAX_TOKENS, **GREEDY)[0] == single[i]

    stats = [o.metrics.spec_decode for o in outs]
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    assert drafted > 0, "nothing was speculated: the test would prove nothing"
    assert max(len(s.accepted_per_pos) for s in stats) <= k
    if proposer == "draft":
        assert accepted > 0, "the noisy-copy draft should be accepted sometimes"
        if k >= 2:
            assert accepted < drafted, "some drafts should be rejected (mid-run rollback)"
    else:
        assert accepted > 0, "the repetitive prompt should give accepted n-gram drafts"


@pytest.mark.parametrize("fam", FAMILIES)
def test_unrelated_draft_model_of_another_size(fam, plain, llm_cache, tiny_models, tiny_draft):
    """tiny_draft (1-layer llama, shares the tokenizer) drafting for every family, k=4."""
    batched, _ = plain(fam)
    llm = llm_cache.get(tiny_models[fam], speculative_model=tiny_draft, num_speculative_tokens=4)
    outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == batched
    assert sum(o.metrics.spec_decode.num_draft_tokens for o in outs) > 0


@pytest.mark.parametrize("fam", FAMILIES)
def test_self_draft_accepts_everything(fam, plain, llm_cache, tiny_models):
    batched, _ = plain(fam)
    k = 4
    llm = llm_cache.get(tiny_models[fam], speculative_model=tiny_models[fam], num_speculative_tokens=k)
    outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == batched
    for o in outs:
        s = o.metrics.spec_decode
        assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens, s
        assert s.acceptance_rate == 1.0

    # Sampling too: the draft's q equals the target's p bitwise (row-invariant kernels), so u * q < p always.
    outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, temperature=0.8, seed=3, ignore_eos=True)
    for o in outs:
        s = o.metrics.spec_decode
        assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens, s


def test_self_draft_token_accounting(one_thread, tiny_models):
    """k=4, max_tokens=16: the prefill emits 1 token, then 3 verification steps emit 4 accepted + 1 bonus
    each. Metrics follow vLLM's definitions exactly."""
    llm = LLM(str(tiny_models["qwen3"]), speculative_model=str(tiny_models["qwen3"]), num_speculative_tokens=4,
              max_model_len=128)
    out = _generate(llm, [PROMPTS[0]], max_tokens=16, **GREEDY)[0]
    s = out.metrics.spec_decode
    assert len(out.outputs[0].token_ids) == 16
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 12, 12)
    assert s.accepted_per_pos == [3, 3, 3, 3]
    assert s.mean_acceptance_length == 5.0
    assert s.per_position_acceptance_rate == [1.0] * 4
    agg = llm.spec_decode_metrics
    assert agg.as_dict() == s.as_dict()


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_metrics_add_up(proposer, one_thread, tiny_models, noisy_drafts):
    """Sum over requests == engine aggregate; rates follow vLLM's definitions; counts are consistent."""
    spec_model = noisy_drafts["opt"] if proposer == "draft" else "[ngram]"
    llm = LLM(str(tiny_models["opt"]), speculative_model=str(spec_model), num_speculative_tokens=4,
              max_model_len=128)  # a fresh engine: its aggregate covers exactly these requests
    outs = _generate(llm, PROMPTS + PROMPTS[:2], max_tokens=MAX_TOKENS, **GREEDY)
    per = [o.metrics.spec_decode for o in outs]
    agg = llm.spec_decode_metrics
    assert agg.num_drafts == sum(s.num_drafts for s in per) > 0
    assert agg.num_draft_tokens == sum(s.num_draft_tokens for s in per)
    assert agg.num_accepted_tokens == sum(s.num_accepted_tokens for s in per) > 0
    width = max(len(s.accepted_per_pos) for s in per)
    summed = [sum(s.accepted_per_pos[i] if i < len(s.accepted_per_pos) else 0 for s in per) for i in range(width)]
    assert agg.accepted_per_pos[:width] == summed and not any(agg.accepted_per_pos[width:])
    for s in per + [agg]:
        if not s.num_drafts:
            continue
        assert s.acceptance_rate == pytest.approx(s.num_accepted_tokens / s.num_draft_tokens)
        assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)
        assert s.per_position_acceptance_rate == pytest.approx([a / s.num_drafts for a in s.accepted_per_pos])
        # Accepting position i+1 requires accepting position i; the positions add up to the total.
        assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:]))
        assert s.accepted_per_pos[0] <= s.num_drafts
        assert sum(s.accepted_per_pos) == s.num_accepted_tokens <= s.num_draft_tokens <= 4 * s.num_drafts
    for o in outs:
        # Every output token is the prefill's, an accepted draft, or one recovered/bonus token per step.
        s = o.metrics.spec_decode
        n = len(o.outputs[0].token_ids)
        assert n == MAX_TOKENS
        assert s.num_drafts + s.num_accepted_tokens <= n - 1
    d = agg.as_dict()
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos", "acceptance_rate",
                "mean_acceptance_length", "per_position_acceptance_rate"):
        assert key in d


@pytest.mark.parametrize("quantization", [None, "int8", "w8a8", "w4a8"])
@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_quantized_speculative_greedy_equals_plain(quantization, proposer, llm_cache, tiny_models, noisy_drafts):
    """Quantized weights (and w8a8's quantized activations) still give plain greedy's ids under speculation,
    batched and one by one, with the kernel's default thread count."""
    import torch

    fam = "qwen2"
    with_threads = 2
    prev = torch.get_num_threads()
    torch.set_num_threads(with_threads)
    try:
        base = llm_cache.get(tiny_models[fam], quantization=quantization)
        batched = gen_ids(base, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
        assert batched == [gen_ids(base, [p], max_tokens=MAX_TOKENS, **GREEDY)[0] for p in PROMPTS]
        spec_model = noisy_drafts[fam] if proposer == "draft" else "[ngram]"
        llm = llm_cache.get(tiny_models[fam], quantization=quantization, speculative_model=spec_model,
                            num_speculative_tokens=4)
        outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
    finally:
        torch.set_num_threads(prev)
    assert [list(o.outputs[0].token_ids) for o in outs] == batched
    assert sum(o.metrics.spec_decode.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("quantization", [None, "w8a8"])
def test_default_pair_speculative_greedy_equals_plain(one_thread, quantization):
    """The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft), k=4, batch of 2 prompts of different
    lengths, 32 tokens: draft-model and n-gram speculation give plain greedy's ids, at the default dtype and
    with int8 weights and activations (the draft then in 4-bit w4a8, the recommended CPU setup).

    To load the 1.5B target once, one engine serves all three runs: plain decoding is the same engine with
    its proposer removed (exactly the state of an engine built without speculation), and n-gram is the same
    engine with an n-gram proposer swapped in."""
    from specdecode.speculative.ngram import NgramProposer

    llm = LLM(num_speculative_tokens=4, max_model_len=512, quantization=quantization,
              speculative_model_quantization="w4a8" if quantization else None)
    assert llm.config.speculative.method == "draft_model"
    prompts = ["def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
               "<|im_start|>user\nWrite a Python function that reverses a linked list, with a docstring "
               "and type hints.<|im_end|>\n<|im_start|>assistant\n"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def run():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], [o.metrics.spec_decode for o in outs]

    draft_ids, draft_stats = run()
    proposer = llm.engine.proposer
    try:
        llm.engine.proposer = None
        plain_ids, plain_stats = run()
        llm.engine.proposer = NgramProposer(1, 4)
        ngram_ids, ngram_stats = run()
    finally:
        llm.engine.proposer = proposer
    assert all(s.num_drafts == 0 for s in plain_stats)
    assert draft_ids == plain_ids
    assert ngram_ids == plain_ids
    assert sum(s.num_accepted_tokens for s in draft_stats) > 0  # the real draft agrees with the target often
    assert sum(s.num_draft_tokens for s in ngram_stats) > 0


def test_draft_p_min_stops_drafting_early_and_stays_exact(plain, llm_cache, tiny_models, noisy_drafts):
    batched, _ = plain("llama")
    drafted = {}
    for p_min in (0.0, 0.99):
        llm = llm_cache.get(tiny_models["llama"], speculative_model=noisy_drafts["llama"],
                            num_speculative_tokens=8, speculative_draft_p_min=p_min)
        outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outs] == batched
        drafted[p_min] = sum(o.metrics.spec_decode.num_draft_tokens for o in outs)
    # A random tiny draft is almost never 99% sure of a token, so drafts stop after their first token.
    assert drafted[0.99] < drafted[0.0]


def test_draft_confidence_stops_drafting_early_and_stays_exact(plain, llm_cache, tiny_models, noisy_drafts):
    """speculative_draft_confidence: the draft stops once the product of its top probabilities falls below
    the threshold (k = 8 is then only the cap). Same ids; a high threshold drafts fewer tokens."""
    batched, _ = plain("llama")
    drafted, per_step = {}, {}
    for conf in (0.0, 0.5):
        llm = llm_cache.get(tiny_models["llama"], speculative_model=noisy_drafts["llama"],
                            num_speculative_tokens=8, speculative_draft_confidence=conf)
        assert llm.engine.proposer.confidence == conf
        outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
        assert [list(o.outputs[0].token_ids) for o in outs] == batched
        stats = [o.metrics.spec_decode for o in outs]
        drafted[conf] = sum(s.num_draft_tokens for s in stats)
        per_step[conf] = drafted[conf] / sum(s.num_drafts for s in stats)
    assert drafted[0.5] < drafted[0.0]
    assert 1.0 <= per_step[0.5] < per_step[0.0]  # every step still drafts its first token
    # With adaptive k, k only decides whether the draft model runs; the confidence sets the depth.
    llm = llm_cache.get(tiny_models["llama"], speculative_model=noisy_drafts["llama"], num_speculative_tokens=8,
                        speculative_draft_confidence=0.5, speculative_adaptive=True)
    outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == batched


def test_a_copy_opened_by_the_draft_model_stays_exact(plain, llm_cache, tiny_models, noisy_drafts, monkeypatch):
    """ngram_first: when the draft model's latest token completes an n-gram seen before, the engine appends
    what followed it and the draft model stops. A lookup that knows plain greedy's continuation (corrupted
    at every third call, so copies are also rejected part way) and finds nothing on the contexts the steps
    start from, so every copy is one that draft-model tokens opened."""
    import specdecode.speculative.ngram as le

    fam = "llama"
    want = plain(fam)[0]
    llm = llm_cache.get(tiny_models[fam], speculative_model=noisy_drafts[fam], num_speculative_tokens=3,
                        speculative_ngram_first=True, prompt_lookup_num_tokens=6)
    eng = llm.engine
    starts = set()  # (request slot, context length) of every step's own lookup
    calls = [0]

    def lookup(tokens, k, lo, hi):
        calls[0] += 1
        for p, out in zip(PROMPTS, want):
            ids = eng.input_processor.encode_prompt(p)
            n = len(tokens) - len(ids)
            if n >= 0 and tokens[:len(ids)] == ids and tokens[len(ids):] == out[:n]:
                if any(r.all_token_ids == tokens for r in eng.scheduler.running):
                    return []  # a step's own lookup: leave it to the draft model
                found = out[n:n + k]
                if calls[0] % 3 == 0 and len(found) > 1:
                    found = found[:1] + [(found[1] + 1) % 50] + found[2:]
                return found
        return []
    copies = []
    real_observe = eng.proposer.policy.learn

    def observe(r, drafted, accepted, looked_up, found, emitted, copied_from):
        copies.append((copied_from, len(drafted), accepted))
        return real_observe(r, drafted, accepted, looked_up, found, emitted, copied_from)
    monkeypatch.setattr(le, "ngram_lookup", lookup)
    monkeypatch.setattr(eng.proposer.policy, "learn", observe)
    outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    opened = [c for c in copies if c[0] is not None]
    assert opened and all(1 <= start < n for start, n, _ in opened)
    assert any(a > start for start, _, a in opened)  # copied tokens were accepted
    assert any(a < n for _, n, a in opened)          # and some copies were cut short
    assert max(n for _, n, _ in opened) > 3          # a copy runs past the draft model's k


def test_truncated_draft_vocab_keeps_greedy_exact(plain, llm_cache, tiny_models, noisy_drafts):
    """speculative_draft_vocab_size: the draft scores only low ids (+ specials); ids it cannot propose still
    come out of the target, so greedy output is unchanged."""
    import torch

    from specdecode.speculative.draft_model import TruncatedHead

    batched, _ = plain("llama")
    llm = llm_cache.get(tiny_models["llama"], speculative_model=noisy_drafts["llama"], num_speculative_tokens=4,
                        speculative_draft_vocab_size=256)
    head = llm.engine.proposer.runner.model.lm_head
    assert isinstance(head, TruncatedHead) and 256 <= len(head.keep) < llm.engine.target.vocab_size
    logits = head(torch.randn(3, head.sub.in_features))
    dropped = torch.ones(logits.shape[-1], dtype=torch.bool)
    dropped[head.keep] = False
    assert torch.isinf(logits[:, dropped]).all() and torch.isfinite(logits[:, head.keep]).all()
    outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == batched
    assert any(t >= 256 for ids in batched for t in ids)  # the target does emit tokens the draft cannot propose
    assert sum(o.metrics.spec_decode.num_accepted_tokens for o in outs) > 0


def test_draft_in_its_own_quantization_keeps_greedy_exact(plain, llm_cache, tiny_models, noisy_drafts):
    """speculative_model_quantization gives the draft its own weight format (here 4-bit, the target fp32):
    only acceptance may change, never the ids."""
    from specdecode.layers.linear import Linear

    fam = "qwen2"
    llm = llm_cache.get(tiny_models[fam], speculative_model=noisy_drafts[fam], num_speculative_tokens=3,
                        speculative_model_quantization="w4a8")
    draft_fmts = {m.packed.fmt for m in llm.engine.proposer.runner.model.modules()
                  if isinstance(m, Linear) and m.packed is not None}
    target_fmts = {m.packed.fmt for m in llm.engine.target.model.modules()
                   if isinstance(m, Linear) and m.packed is not None}
    assert draft_fmts == {"w4a8"} and target_fmts == {"fp32"}
    outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == plain(fam)[0]
    assert sum(o.metrics.spec_decode.num_accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("fam", ["llama", "qwen2"])
def test_ngram_first_keeps_greedy_exact(fam, plain, llm_cache, tiny_models, noisy_drafts):
    """Prompt lookup where the context repeats, the (noisy) draft model elsewhere: plain greedy's ids, and
    both sources of drafts are used."""
    llm = llm_cache.get(tiny_models[fam], speculative_model=noisy_drafts[fam], num_speculative_tokens=4,
                        speculative_ngram_first=True, ngram_prompt_lookup_min=2)
    import specdecode.speculative.ngram as le

    looked = []

    def counting_lookup(*args):
        found = real_lookup(*args)
        looked.append(len(found) > 0)
        return found
    real_lookup, le.ngram_lookup = le.ngram_lookup, counting_lookup
    try:
        outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
    finally:
        le.ngram_lookup = real_lookup
    proposer = llm.engine.proposer
    assert [list(o.outputs[0].token_ids) for o in outs] == plain(fam)[0]
    assert sum(looked) > 0 and proposer.draft_runner.num_passes > 0


def test_deeper_lookups_than_the_draft_model_keep_greedy_exact(plain, llm_cache, tiny_models, noisy_drafts,
                                                              monkeypatch):
    """prompt_lookup_num_tokens: lookups draft up to 8 tokens while the draft model drafts 2. A lookup that
    knows plain greedy's continuation, corrupted at every third step, so that deep drafts are verified, cut
    short and followed by draft-model steps whose cache must catch up on the copied tokens."""
    import specdecode.speculative.ngram as le

    fam = "llama"
    want = plain(fam)[0]
    llm = llm_cache.get(tiny_models[fam], speculative_model=noisy_drafts[fam], num_speculative_tokens=2,
                        speculative_ngram_first=True, prompt_lookup_num_tokens=8)
    caps, calls = [], [0]

    def lookup(tokens, k, lo, hi):
        caps.append(k)
        calls[0] += 1
        for p, out in zip(PROMPTS, want):
            ids = llm.engine.input_processor.encode_prompt(p)
            if tokens[:len(ids)] == ids and tokens[len(ids):] == out[:len(tokens) - len(ids)]:
                found = out[len(tokens) - len(ids):][:k]
                if calls[0] % 3 == 0 and len(found) > 3:
                    found = found[:3] + [(found[3] + 1) % 50] + found[4:]  # rejected at position 4
                return found if calls[0] % 5 else []  # every fifth step: the draft model's turn
        return []
    monkeypatch.setattr(le, "ngram_lookup", lookup)
    outs = _generate(llm, PROMPTS, max_tokens=MAX_TOKENS, **GREEDY)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    stats = llm.engine.spec_stats
    assert set(caps) >= {8} and max(caps) == 8
    assert len(stats.accepted_per_pos) == 8 and stats.accepted_per_pos[4] > 0  # runs past the draft model's k
    assert llm.engine.proposer.draft_runner.num_passes > 0
