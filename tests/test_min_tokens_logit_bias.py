"""min_tokens and logit_bias (SamplingParams and the server's request fields), exact under speculation.

Both change the target's logits per verified row (row j of a request follows its output plus the drafts
before it), so a draft that plain decoding could not produce at its position is rejected: greedy output is the
same with and without speculation, and sampling follows the processed target (chi-square test)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers_spec import copy_model, edit_config, llm_cache, one_thread, sharp_draft, sharp_target  # noqa: F401
from test_sampling_distribution import ALPHA, chi2_pvalue, unseeded

from specdecode import SamplingParams
from specdecode.layers.sampler import logits_to_probs, request_logits

PROMPT = [17, 42, 99, 17, 42, 99, 17, 42]
SPEC = {
    "none": {},
    "ngram": dict(speculative_model="[ngram]", num_speculative_tokens=4, ngram_prompt_lookup_min=1),
    "draft_model": "draft",
}
NEG = float("-inf")


# ---------------------------------------------------------------- the per-row processing, unit level
def test_rows_are_processed_with_their_own_history():
    """Row j follows len(output) + j tokens: min_tokens masks the stop tokens exactly on the rows before it;
    logit_bias shifts every row; the grammar mask comes last and outranks min_tokens."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 8, generator=g)
    p = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5], logit_bias={1: 2.5, 6: -100})
    out = request_logits(rows, p, output=[7], drafts=[3, 4, 2], eos_ids={2})
    expect = rows.clone()
    expect[:, 1] += 2.5
    expect[:, 6] -= 100
    expect[:2, [2, 5]] = NEG  # rows 0 and 1 follow 1 and 2 output tokens (< 3); rows 2 and 3 follow 3 and 4
    assert torch.equal(out, expect)
    # ignore_eos: EOS is no stop token, so min_tokens leaves it alone (vLLM); stop_token_ids stay masked
    out = request_logits(rows, p.clone(ignore_eos=True, logit_bias=None), [7], [3, 4, 2], {2})
    expect = rows.clone()
    expect[:2, 5] = NEG
    assert torch.equal(out, expect)
    # nothing to do: the same tensor back (no copy on the common path)
    assert request_logits(rows, SamplingParams(), [7], [3, 4, 2], {2}) is rows
    assert request_logits(rows, SamplingParams(min_tokens=1), [7], [3, 4, 2], {2}) is rows

    # a grammar that allows only stopping (token 2) on rows 1..: min_tokens would leave nothing, the grammar wins
    def only_eos_after_first(x: torch.Tensor) -> torch.Tensor:
        allowed = torch.ones_like(x, dtype=torch.bool)
        allowed[1:] = False
        allowed[1:, 2] = True
        return torch.where(allowed, x, NEG)

    out = request_logits(rows, SamplingParams(min_tokens=5), [7], [3, 4, 2], {2}, only_eos_after_first)
    assert out[0, 2] == NEG and torch.isfinite(out[0]).sum() == 7
    assert (torch.isfinite(out[1:]).sum(-1) == 1).all() and torch.isfinite(out[1:, 2]).all()


def test_logit_bias_outside_the_vocabulary_is_an_error():
    with pytest.raises(ValueError, match="logit_bias names token id 8"):
        request_logits(torch.zeros(1, 8), SamplingParams(logit_bias={8: 1.0}), [], [], set())


@pytest.mark.parametrize("kwargs, needle", [
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=1.5), "min_tokens"),
    (dict(min_tokens=9, max_tokens=8), "min_tokens must be <= max_tokens"),
    (dict(logit_bias={"x": 1}), "logit_bias keys"), (dict(logit_bias={-1: 1}), "logit_bias keys"),
    (dict(logit_bias={3: 100.5}), "logit_bias values"), (dict(logit_bias={3: float("nan")}), "logit_bias values"),
    (dict(logit_bias=[3]), "logit_bias must be a dict"),
])
def test_params_validation(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_params_normalise_json_keys():
    assert SamplingParams(logit_bias={"12": 3, 4: -1.5}).logit_bias == {12: 3.0, 4: -1.5}
    assert SamplingParams(logit_bias={}).logit_bias is None


# ---------------------------------------------------------------- greedy, end to end, with and without speculation
@pytest.fixture(scope="module")
def plain_greedy(one_thread, llm_cache, sharp_target):
    llm = llm_cache.get(sharp_target, max_model_len=256)
    out = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False,
                       sampling_params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def eos_early(plain_greedy, sharp_target, tmp_path_factory):
    """(model dir, i, eos): sharp_target with the token it greedily emits at output position i (i >= 2, a token
    not seen before) made an EOS id, so that plain greedy decoding ends after i + 1 tokens."""
    i = next(i for i in range(2, len(plain_greedy))
             if plain_greedy[i] not in plain_greedy[:i] and plain_greedy[i] != 0)
    d = copy_model(sharp_target, tmp_path_factory.mktemp("eos_early") / "model")
    edit_config(d, eos_token_id=[0, plain_greedy[i]])
    return d, i, plain_greedy[i]


@pytest.fixture(scope="module")
def engines(one_thread, llm_cache, sharp_draft):
    def get(model, spec: str):
        kw = SPEC[spec]
        if kw == "draft":
            kw = dict(speculative_model=sharp_draft, num_speculative_tokens=4)
        return llm_cache.get(model, max_model_len=256, **kw)
    return get


def _greedy(llm, **kw) -> tuple[list[int], str, str]:
    o = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False,
                     sampling_params=SamplingParams(temperature=0, **kw))[0].outputs[0]
    assert o.finish_reason in ("stop", "length"), o
    return list(o.token_ids), o.finish_reason, o.text


def test_min_tokens_greedy_is_exact_under_speculation(eos_early, plain_greedy, engines):
    model, i, eos = eos_early
    min_tokens = i + 10
    runs = {}
    for spec in SPEC:
        llm = engines(model, spec)
        without = _greedy(llm, max_tokens=40)
        assert without[0] == plain_greedy[:i + 1] and without[1] == "stop", (spec, without)  # the early EOS
        runs[spec] = _greedy(llm, max_tokens=40, min_tokens=min_tokens)
    toks, reason, _ = runs["none"]
    assert len(toks) >= min_tokens > len(plain_greedy[:i + 1])
    assert toks[:i] == plain_greedy[:i] and toks[i] != eos  # the EOS at position i was masked, nothing else
    assert not {0, eos} & set(toks[:min_tokens - 1])
    assert reason == "length" or toks[-1] in (0, eos)
    for spec, run in runs.items():
        assert run == runs["none"], spec


def test_min_tokens_holds_back_stop_strings_and_stop_token_ids(plain_greedy, engines, sharp_target):
    """vLLM: before min_tokens a stop string does not end the request; after it, a match that ends in new text
    does. A stop token id is masked like EOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(sharp_target))
    stop_text = tok.decode(plain_greedy[1:2])
    assert stop_text.strip(), "need a visible token to stop on"
    for spec in SPEC:
        llm = engines(sharp_target, spec)
        toks, reason, text = _greedy(llm, max_tokens=30, stop=[stop_text], ignore_eos=True)
        assert len(toks) <= 2 and reason == "stop", (spec, toks)
        toks, reason, text = _greedy(llm, max_tokens=30, stop=[stop_text], ignore_eos=True, min_tokens=6)
        assert len(toks) >= 6, (spec, toks)
        assert reason == "length" or stop_text not in text, (spec, text)
        ids, _, _ = _greedy(llm, max_tokens=12, stop_token_ids=[plain_greedy[1]], ignore_eos=True, min_tokens=4)
        assert len(ids) >= 4 and plain_greedy[1] not in ids[:3], (spec, ids)
        if spec == "none":
            ref = ids
        assert ids == ref, spec


def test_logit_bias_greedy_is_exact_under_speculation(plain_greedy, engines, sharp_target):
    forced = 300 if 300 not in plain_greedy[:8] else 301
    runs = {}
    for spec in SPEC:
        llm = engines(sharp_target, spec)
        toks, _, _ = _greedy(llm, max_tokens=8, ignore_eos=True, logit_bias={forced: 100})
        assert toks == [forced] * 8, (spec, toks)
        # -100 on every token plain greedy decoding emits first: the output must leave that path, identically
        runs[spec] = _greedy(llm, max_tokens=12, ignore_eos=True, logit_bias={t: -100 for t in plain_greedy[:3]})
    toks = runs["none"][0]
    assert not set(toks) & set(plain_greedy[:3])
    assert all(run == runs["none"] for run in runs.values()), runs


def test_min_tokens_under_a_grammar(engines, sharp_target):
    """min_tokens holds the end of a grammar back while the grammar allows more; where it allows only the end,
    the grammar wins (the request ends, valid); the same with speculation."""
    from specdecode.structured import StructuredOutputsParams

    runs = {}
    for spec in SPEC:
        llm = engines(sharp_target, spec)
        toks, reason, text = _greedy(llm, max_tokens=20, min_tokens=8,
                                     structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        assert reason == "stop" and text in ("yes", "no"), (spec, text)
        # +100 on EOS: the grammar ends the output as soon as it may, unless min_tokens holds the end back
        letters = dict(max_tokens=30, logit_bias={0: 100},
                       structured_outputs=StructuredOutputsParams(regex="[a-z]{1,30}"))
        short = _greedy(llm, **letters)
        runs[spec] = _greedy(llm, min_tokens=6, **letters)
        assert short[1] == "stop" and len(short[0]) <= 2, (spec, short)
        assert runs[spec][1] == "stop" and len(runs[spec][0]) >= 6 and runs[spec][2].isalpha(), (spec, runs[spec])
    assert all(run == runs["none"] for run in runs.values()), runs


def test_logit_bias_outside_vocabulary_is_refused_when_added(engines, sharp_target):
    llm = engines(sharp_target, "none")
    with pytest.raises(ValueError, match="logit_bias names token id 1000000, outside the vocabulary"):
        llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False,
                     sampling_params=SamplingParams(temperature=0, max_tokens=4, logit_bias={10 ** 6: 1.0}))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(prompt_token_ids=[PROMPT], use_tqdm=False, sampling_params=SamplingParams(temperature=0,
                                                                                                max_tokens=4))
    assert out[0].outputs[0].finish_reason == "length"


# ---------------------------------------------------------------- sampling: the processed target, exactly
SAMPLED = dict(temperature=0.7, min_tokens=2, logit_bias={17: 2.0, 42: 1.5, 99: -3.0})
N_SAMPLES = 2000
N_BROKEN = 300


def _processed_marginal(model_dir, params: SamplingParams, prompt: list[int], eos: set[int]) -> np.ndarray:
    """sum_x1 p(x1) p(x2 | x1), each row with logit_bias added and the stop tokens masked (both rows are
    before min_tokens=2), and only allowed_token_ids kept, then the temperature; computed here from the target's
    logits directly."""
    from specdecode.engine.model_runner import ModelRunner
    from specdecode.models.loader import load_model

    runner = ModelRunner(load_model(model_dir, "float32", "cpu", 64, None), 1, 64, "cpu")
    V = runner.vocab_size
    bias = torch.zeros(V)
    for t, b in params.logit_bias.items():
        bias[t] = b
    stops = sorted(eos | set(params.stop_token_ids))

    def probs(logits: torch.Tensor) -> torch.Tensor:
        x = logits.float() + bias
        x[stops] = NEG
        if params.allowed_token_ids:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[params.allowed_token_ids] = True
            x[~keep] = NEG
        return logits_to_probs(x[None], [SamplingParams(temperature=params.temperature)])[0].double()

    p1 = probs(runner.prefill(0, prompt))
    marg = torch.zeros_like(p1)
    for x1 in torch.nonzero(p1 > 1e-9).flatten().tolist():
        marg += p1[x1] * probs(runner.forward_rows([(0, len(prompt), [x1])], all_logits=True)[0][0])
    return marg.numpy()


def _second_tokens(llm, params: SamplingParams, n: int, seed0: int) -> np.ndarray:
    sps = unseeded(params, n, seed0, max_tokens=3)
    outs = llm.generate(prompt_token_ids=[PROMPT[:6]] * n, sampling_params=sps, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) >= 2 for o in outs)
    return np.bincount([o.outputs[0].token_ids[1] for o in outs], minlength=llm.engine.target.vocab_size)


def test_sampling_follows_the_processed_target(one_thread, llm_cache, sharp_target, sharp_draft, plain_greedy,
                                               monkeypatch):
    """The 2nd token is the first one the rejection sampler emits (after one draft-model token); it must follow
    the target with logit_bias and min_tokens applied at its row. Its most likely value is made a stop token, so
    min_tokens moves a lot of mass. The same test catches an engine that processes only the prefill's row."""
    llm = llm_cache.get(sharp_target, speculative_model=sharp_draft, num_speculative_tokens=1, max_model_len=64,
                        max_num_seqs=16)
    base = SamplingParams(**SAMPLED)
    top = int(np.argmax(_processed_marginal(sharp_target, base, PROMPT[:6], llm.engine.eos_token_ids)))
    params = base.clone(stop_token_ids=[top])
    marg = _processed_marginal(sharp_target, params, PROMPT[:6], llm.engine.eos_token_ids)
    stats = llm.engine.spec_stats
    drafted0 = stats.num_draft_tokens
    second = _second_tokens(llm, params, N_SAMPLES, seed0=0)
    assert stats.num_draft_tokens - drafted0 >= N_SAMPLES // 2
    pval = chi2_pvalue(second, marg)
    assert pval > ALPHA, f"2nd token does not follow the processed target (p={pval:.2e})"

    import specdecode.engine.llm_engine as eng

    real = eng.request_logits
    monkeypatch.setattr(eng, "request_logits", lambda rows, p, output, drafts, *a: rows if output else
                        real(rows, p, output, drafts, *a))
    broken = _second_tokens(llm, params, N_BROKEN, seed0=10 ** 6)
    pval = chi2_pvalue(broken, marg)
    assert pval < ALPHA, f"an engine that skips the verified rows went unnoticed (p={pval:.2e})"


def test_sampling_with_allowed_token_ids_follows_the_masked_target(one_thread, llm_cache, sharp_target,
                                                                    sharp_draft):
    """The same 2nd-token test with allowed_token_ids: the rejection sampler must take the masked target's
    distribution at the verified row, where the draft model proposes from the whole vocabulary."""
    llm = llm_cache.get(sharp_target, speculative_model=sharp_draft, num_speculative_tokens=1, max_model_len=64,
                        max_num_seqs=16)
    base = SamplingParams(**SAMPLED)
    marg = _processed_marginal(sharp_target, base, PROMPT[:6], llm.engine.eos_token_ids)
    # the likeliest second tokens, less the top one: the mask moves mass and drafts of the top token are rejected
    allowed = [int(t) for t in np.argsort(marg)[::-1][1:13]]
    params = base.clone(allowed_token_ids=allowed)
    marg = _processed_marginal(sharp_target, params, PROMPT[:6], llm.engine.eos_token_ids)
    second = _second_tokens(llm, params, N_SAMPLES, seed0=0)
    assert set(np.nonzero(second)[0]) <= set(allowed)
    pval = chi2_pvalue(second, marg)
    assert pval > ALPHA, f"2nd token does not follow the masked target (p={pval:.2e})"


# ---------------------------------------------------------------- the server: both routes, through the openai client
@pytest.fixture(scope="module")
def server(one_thread, eos_early):
    from test_server import serve

    from specdecode.entrypoints.openai.api_server import build_app

    kw = {"model": str(eos_early[0]), "max_model_len": 256, "max_num_seqs": 4, **SPEC["ngram"]}
    with serve(build_app(kw, "tiny", None)) as url:
        yield url


def _client(url: str):
    import openai
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_server_min_tokens_and_logit_bias(server, eos_early, engines):
    model, i, _ = eos_early
    client = _client(server)
    offline = _greedy(engines(model, "none"), max_tokens=40, min_tokens=i + 10)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    assert r.usage.completion_tokens == i + 1 and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                  extra_body={"min_tokens": i + 10})
    assert r.usage.completion_tokens == len(offline[0]) >= i + 10 and r.choices[0].text == offline[2]
    msgs = [{"role": "user", "content": "Say something."}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=30, temperature=0,
                                       extra_body={"min_tokens": 25})
    assert r.usage.completion_tokens >= 25
    # logit_bias: the official client's field, token ids as string keys
    forced = 300
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == engines(model, "none").get_tokenizer().decode([forced] * 6)
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                       logit_bias={str(forced): 100})
    assert r.choices[0].message.content == engines(model, "none").get_tokenizer().decode([forced] * 6)


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
@pytest.mark.parametrize("extra, needle", [
    ({"logit_bias": {"1000000": 5}}, "outside this model's vocabulary"),
    ({"logit_bias": {"abc": 5}}, "logit_bias keys"),
    ({"logit_bias": {"\u00b2": 5}}, "logit_bias keys"),  # int() raises on a superscript two
    ({"logit_bias": {"\u0661": 5}}, "logit_bias keys"),  # and reads an Arabic-Indic one as 1
    ({"logit_bias": {"7" * 5000: 5}}, "logit_bias keys"),
    ({"logit_bias": {"5": 150}}, "logit_bias values"),
    ({"logit_bias": {"5": "high"}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens must be <= max_tokens"),
])
def test_server_rejects_bad_values_by_name(server, route, extra, needle):
    import httpx

    body = {"model": "tiny", "max_tokens": 4, **extra}
    body.update({"prompt": "x"} if route == "completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = httpx.post(f"{server}/v1/{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["param"] is None or err["param"].split(".")[0] in ("logit_bias", "min_tokens"), err
    assert httpx.get(f"{server}/health").status_code == 200


def test_a_bad_prompt_later_in_the_list_leaves_the_engine_clean(engines, sharp_target):
    llm = engines(sharp_target, "none")
    good = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompt_token_ids=[PROMPT, PROMPT], use_tqdm=False, sampling_params=[
            good, SamplingParams(temperature=0, max_tokens=4, logit_bias={10 ** 6: 1.0})])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.pool.num_used_blocks == 0


# ---------------------------------------------------------------- vLLM's allowed_token_ids and bad_words
def test_bans_follow_each_rows_history():
    """Row j follows output + drafts[:j]: a bad word's last token is banned exactly on the rows whose history ends
    with the rest of it; a one-token word everywhere; allowed_token_ids leaves only its ids, before logit_bias."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(4, 8, generator=g)
    p = SamplingParams(temperature=0, allowed_token_ids=[1, 2, 3, 4, 6], logit_bias={6: 1.0})
    out = request_logits(rows, p, output=[7, 3], drafts=[4, 1, 2], eos_ids={0}, bad_words_ids=[[3, 4, 1], [6]])
    expect = torch.full_like(rows, NEG)
    expect[:, [1, 2, 3, 4]] = rows[:, [1, 2, 3, 4]]
    expect[1, 1] = NEG  # row 1 follows [7, 3, 4]: the word [3, 4, 1] would end here
    assert torch.equal(out, expect)  # token 6 is banned on every row, so its bias changes nothing
    with pytest.raises(ValueError, match="leave no token"):  # allowed only EOS while min_tokens holds it back
        request_logits(rows, SamplingParams(allowed_token_ids=[0], min_tokens=3), [7], [3], {0})


@pytest.mark.parametrize("kwargs, needle", [
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"), ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"), ({"bad_words": ["a\ud800"]}, "bad_words"),
])
def test_ban_params_validation(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_allowed_token_ids_and_bad_words_are_exact_under_speculation(plain_greedy, engines, sharp_target):
    word = engines(sharp_target, "none").get_tokenizer().decode(plain_greedy[2:3]).strip()
    assert word, "need a visible token to ban"
    allowed = sorted(set(plain_greedy[:6]) | {300, 301})
    runs = {}
    for spec in SPEC:
        llm = engines(sharp_target, spec)
        seqs = llm.engine.input_processor.bad_words_ids([word])
        assert [plain_greedy[2]] in seqs or any(s[-1] == plain_greedy[2] for s in seqs), seqs
        banned, _, _ = _greedy(llm, max_tokens=16, ignore_eos=True, bad_words=[word])
        assert not any(banned[i:i + len(s)] == s for s in seqs for i in range(len(banned))), (spec, banned)
        only, _, _ = _greedy(llm, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
        assert set(only) <= set(allowed), (spec, only)
        runs[spec] = (banned, only)
    assert runs["none"][0] != plain_greedy[:16]  # plain greedy decoding wrote the word at position 2
    assert all(run == runs["none"] for run in runs.values()), runs
    # allowed only EOS while min_tokens holds it back: refused when added, naming the field
    with pytest.raises(ValueError, match="allowed_token_ids holds only stop tokens"):
        engines(sharp_target, "ngram").generate(prompt_token_ids=[PROMPT], use_tqdm=False, sampling_params=[
            SamplingParams(temperature=0, max_tokens=4, min_tokens=3, allowed_token_ids=[0])])


def test_server_allowed_token_ids_and_bad_words(server, eos_early, engines):
    import httpx

    model, _, _ = eos_early
    client = _client(server)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"allowed_token_ids": [300]})
    assert r.choices[0].text == engines(model, "none").get_tokenizer().decode([300] * 6)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    first = plain.choices[0].text.split()[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "bad_words": [first]})
    assert r.choices[0].text != plain.choices[0].text
    for extra, param in (({"allowed_token_ids": [10 ** 7]}, "allowed_token_ids"),
                         ({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"bad_words": [""]}, "bad_words"), ({"bad_words": ["w"] * 257}, "bad_words"),
                         ({"allowed_token_ids": [0], "min_tokens": 1}, "allowed_token_ids")):
        resp = httpx.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, **extra})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (extra, resp.text)
