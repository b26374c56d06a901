"""Seeds are per request; stop conditions that fall inside an accepted run end exactly where plain decoding ends.

For the stop tests the speculative engines accept long runs: a self-draft (draft = target, k=4: every
verification step emits 5 tokens) and n-gram lookup on a model whose greedy output repeats itself. The test
first records, for the unrestricted speculative run, which tokens each engine step emitted; it then puts the
stop condition on a token in the middle of such a run, and checks that the output equals plain decoding's
(token ids, text, finish_reason, stop_reason).
"""
from __future__ import annotations

import pytest

from specdecode import LLM, SamplingParams

from helpers_spec import (GREEDY, PROMPTS, copy_model, edit_config, llm_cache,  # noqa: F401  (fixtures)
                          noisy_drafts, one_thread)

MAX_TOKENS = 40
K = 4


def _gen(llm, prompt, **params):
    return llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**params), use_tqdm=False)[0]


def _step_chunks(llm, prompt, **params) -> list[list[int]]:
    """The tokens each engine step emitted (after stop truncation), for one request."""
    chunks: list[list[int]] = []
    eng = llm.engine
    orig = eng._commit

    def spy(r, tokens, *rest):
        before = r.num_output_tokens
        orig(r, tokens, *rest)
        chunks.append(r.output_token_ids[before:])

    eng._commit = spy
    try:
        _gen(llm, prompt, **params)
    finally:
        del eng._commit
    return chunks


def _mid_run_positions(chunks: list[list[int]]) -> list[int]:
    """Output positions that are neither the last token of their step nor alone in it: a stop there falls
    inside an accepted run, with more tokens of the same step after it."""
    out, pos = [], 0
    for c in chunks:
        out += [pos + i for i in range(len(c) - 1)] if len(c) > 1 else []
        pos += len(c)
    return out


def _same(a, b):
    ca, cb = a.outputs[0], b.outputs[0]
    assert list(ca.token_ids) == list(cb.token_ids)
    assert ca.text == cb.text
    assert (ca.finish_reason, ca.stop_reason) == (cb.finish_reason, cb.stop_reason)


SETUPS = [("llama", "self"), ("opt", "self"), ("qwen3", "self"), ("llama", "ngram"), ("qwen3", "ngram")]


@pytest.fixture(scope="module")
def engines(one_thread, llm_cache, tiny_models):
    def get(fam, proposer):
        plain = llm_cache.get(tiny_models[fam])
        spec_model = tiny_models[fam] if proposer == "self" else "[ngram]"
        spec = llm_cache.get(tiny_models[fam], speculative_model=spec_model, num_speculative_tokens=K)
        return plain, spec
    return get


def _setup(engines, fam, proposer, prompt):
    key = ("setup", fam, proposer, tuple(prompt))
    if key not in _MEMO:
        _MEMO[key] = _setup_uncached(engines, fam, proposer, prompt)
    return _MEMO[key]


def _setup_uncached(engines, fam, proposer, prompt):
    plain, spec = engines(fam, proposer)
    base = _gen(plain, prompt, max_tokens=MAX_TOKENS, **GREEDY)
    chunks = _step_chunks(spec, prompt, max_tokens=MAX_TOKENS, **GREEDY)
    assert sum(chunks, []) == list(base.outputs[0].token_ids)
    mids = _mid_run_positions(chunks)
    assert mids, f"no accepted runs: {[len(c) for c in chunks]}"
    return plain, spec, list(base.outputs[0].token_ids), mids


_MEMO: dict = {}


def _candidate_prompts(engines, fam):
    """PROMPTS, then "echo" prompts p + (plain output of p) + p: after them the model tends to repeat
    text that is in its context, which n-gram lookup drafts in long accepted runs of distinct tokens."""
    if ("prompts", fam) not in _MEMO:
        plain = engines(fam, "self")[0]
        outs = [_gen(plain, p, max_tokens=MAX_TOKENS, **GREEDY).outputs[0].token_ids for p in PROMPTS]
        _MEMO["prompts", fam] = PROMPTS + [p + list(o) + p for p, o in zip(PROMPTS, outs)]
    return _MEMO["prompts", fam]


def _first_new_mid_run(engines, fam, proposer):
    """(plain, spec, prompt, ids, j): token j is mid-run and its first occurrence in the output."""
    for prompt in _candidate_prompts(engines, fam):
        plain, spec, ids, mids = _setup(engines, fam, proposer, prompt)
        js = [j for j in mids if ids[j] not in ids[:j]]
        if js:
            return plain, spec, prompt, ids, js[0]
    raise AssertionError("no token first occurs inside an accepted run for any prompt")


@pytest.mark.parametrize("fam,proposer", SETUPS)
def test_stop_token_id_inside_accepted_run(fam, proposer, engines):
    plain, spec, prompt, ids, j = _first_new_mid_run(engines, fam, proposer)
    params = dict(max_tokens=MAX_TOKENS, stop_token_ids=[ids[j]], **GREEDY)
    want = _gen(plain, prompt, **params)
    assert list(want.outputs[0].token_ids) == ids[:j + 1]
    assert (want.outputs[0].finish_reason, want.outputs[0].stop_reason) == ("stop", ids[j])
    _same(_gen(spec, prompt, **params), want)


@pytest.mark.parametrize("fam,proposer", SETUPS)
def test_max_tokens_inside_accepted_run(fam, proposer, engines):
    prompt = PROMPTS[3]
    plain, spec, ids, mids = _setup(engines, fam, proposer, prompt)
    for j in mids[:3]:
        params = dict(max_tokens=j + 1, **GREEDY)
        want = _gen(plain, prompt, **params)
        assert list(want.outputs[0].token_ids) == ids[:j + 1] and want.outputs[0].finish_reason == "length"
        _same(_gen(spec, prompt, **params), want)


def _stop_string_at(tok, prompt, ids, j) -> str | None:
    """A stop string whose first occurrence in the output text is completed by token j, or None."""
    def text(n):
        return tok.decode(ids[:n], skip_special_tokens=True)

    before, upto = text(j), text(j + 1)
    if "\ufffd" in upto or len(upto) <= len(before) or not upto.startswith(before):
        return None
    for m in range(1, len(upto) + 1):
        s = upto[-m:]
        if s.strip() and s not in upto[:-1]:
            return s
    return None


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("fam,proposer", SETUPS)
def test_stop_string_inside_accepted_run(fam, proposer, include, engines):
    tok = engines(fam, proposer)[0].get_tokenizer()
    found = None
    for prompt in _candidate_prompts(engines, fam):
        plain, spec, ids, mids = _setup(engines, fam, proposer, prompt)
        for j in mids:
            s = _stop_string_at(tok, prompt, ids, j)
            if s is not None:
                found = (prompt, ids, j, s)
                break
        if found:
            break
    assert found, "no stop string completes mid-run (tiny-model output is mostly undecodable bytes)"
    prompt, ids, j, s = found
    params = dict(max_tokens=MAX_TOKENS, stop=[s], include_stop_str_in_output=include, **GREEDY)
    want = _gen(plain, prompt, **params)
    w = want.outputs[0]
    assert (w.finish_reason, w.stop_reason) == ("stop", s)
    assert len(w.token_ids) <= j + 1
    assert w.text.endswith(s) if include else s not in w.text
    _same(_gen(spec, prompt, **params), want)


@pytest.mark.parametrize("fam", ["llama", "opt"])
def test_eos_inside_accepted_run(fam, engines, tiny_models, tiny_dir, llm_cache):
    """The model's EOS token (config.json eos_token_id) appears mid-run: both stop there, unless ignore_eos."""
    plain, spec, prompt, ids, j = _first_new_mid_run(engines, fam, "self")
    eos_dir = copy_model(tiny_models[fam], tiny_dir / f"{fam}_eos{ids[j]}")
    edit_config(eos_dir, eos_token_id=ids[j])
    plain_eos = llm_cache.get(eos_dir)
    spec_eos = llm_cache.get(eos_dir, speculative_model=eos_dir, num_speculative_tokens=K)
    params = dict(max_tokens=MAX_TOKENS, temperature=0.0)
    want = _gen(plain_eos, prompt, **params)
    assert list(want.outputs[0].token_ids) == ids[:j + 1] and want.outputs[0].finish_reason == "stop"
    _same(_gen(spec_eos, prompt, **params), want)
    # ignore_eos=True runs through it
    full = _gen(spec_eos, prompt, max_tokens=MAX_TOKENS, **GREEDY)
    assert list(full.outputs[0].token_ids) == ids


# ---------------------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_same_seed_same_text_with_or_without_other_requests(proposer, one_thread, llm_cache, tiny_models,
                                                             noisy_drafts):
    target = tiny_models["llama"]
    spec_model = noisy_drafts["llama"] if proposer == "draft" else "[ngram]"
    # max_num_seqs=2 with 4 requests: the seeded request shares its steps with changing company.
    llm = llm_cache.get(target, speculative_model=spec_model, num_speculative_tokens=3, max_num_seqs=2)
    mine = SamplingParams(temperature=0.8, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=mine, use_tqdm=False)[0].outputs[0]
    assert llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=mine,
                        use_tqdm=False)[0].outputs[0].token_ids == alone.token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True),              # unseeded
              SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    # The greedy request too: its rows share the verification with sampled ones (greedy rows reach the
    # rejection sampler as logits, sampled ones as probabilities).
    greedy_alone = llm.generate(prompt_token_ids=[PROMPTS[3]], sampling_params=others[2],
                                use_tqdm=False)[0].outputs[0].token_ids
    for pos in (0, 1, 3):
        prompts = [PROMPTS[2], PROMPTS[1], PROMPTS[3]]
        params = list(others)
        prompts.insert(pos, PROMPTS[0])
        params.insert(pos, mine)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        got = outs[pos].outputs[0]
        assert got.token_ids == alone.token_ids and got.text == alone.text, f"seeded request at position {pos}"
        assert outs[3 if pos < 3 else 2].outputs[0].token_ids == greedy_alone, f"greedy request, seeded at {pos}"
    assert sum(o.metrics.spec_decode.num_draft_tokens for o in outs) > 0
    # And the seed matters: another seed gives another sample.
    other = llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=mine.clone(seed=4321),
                         use_tqdm=False)[0].outputs[0]
    assert other.token_ids != alone.token_ids


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_same_seed_same_text_with_and_without_speculation(proposer, one_thread, llm_cache, tiny_models,
                                                          noisy_drafts):
    """A seeded request's text is a function of its seed alone (vLLM's promise), whatever the drafts: plain
    decoding and speculation at two depths give the same tokens, twice."""
    target = tiny_models["llama"]
    spec_model = noisy_drafts["llama"] if proposer == "draft" else "[ngram]"
    plain = llm_cache.get(target, max_num_seqs=2)
    engines = [llm_cache.get(target, speculative_model=spec_model, num_speculative_tokens=k, max_num_seqs=2)
               for k in (2, 4)]
    params = [SamplingParams(temperature=t, top_p=tp, seed=seed, max_tokens=24, ignore_eos=True)
              for seed, (t, tp) in enumerate([(0.8, 1.0), (1.0, 0.9), (0.6, 1.0), (1.2, 0.95)])]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    want = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params,
                                                            use_tqdm=False)]
    for llm in engines:
        for rnd in range(2):
            before = llm.spec_decode_metrics.num_draft_tokens, llm.spec_decode_metrics.num_accepted_tokens
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == want, f"round {rnd}"
            m = llm.spec_decode_metrics
            assert m.num_draft_tokens > before[0]
            # (n-gram drafts of random text are rarely right; the draft model's often are)
            assert m.num_accepted_tokens > before[1] or proposer == "ngram"
    assert len({tuple(w) for w in want}) == len(want)


def test_same_seed_same_text_across_engines(one_thread, tiny_models, noisy_drafts):
    """A fresh engine with a different engine seed and batch size gives the seeded request the same text."""
    kw = dict(speculative_model=str(noisy_drafts["qwen2"]), num_speculative_tokens=2, max_model_len=128)
    a = LLM(str(tiny_models["qwen2"]), seed=0, **kw)
    b = LLM(str(tiny_models["qwen2"]), seed=7, max_num_seqs=3, **kw)
    p = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    out_a = a.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=p, use_tqdm=False)[0].outputs[0]
    outs_b = b.generate(prompt_token_ids=[PROMPTS[0], PROMPTS[1], PROMPTS[2]],
                        sampling_params=[p.clone(seed=None), p, p.clone(seed=6)], use_tqdm=False)
    assert outs_b[1].outputs[0].token_ids == out_a.token_ids
    assert outs_b[1].outputs[0].text == out_a.text
