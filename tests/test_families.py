"""Families beyond the llama-style core, against transformers: Gemma 2 and Gemma 3 (text).

Tiny random models saved by transformers (4 layers, hidden 64, vocab 512, a sliding window of 8 so that every
prompt runs past it, sliding and global layers interleaved; Gemma 2 soft-caps scores and logits, Gemma 3 has
q/k norms, a local RoPE base and linear scaling on its global layers). Each must give transformers' logits and
greedy tokens: plain, under n-gram speculation (k = 4), batched with other prompts, and with prefix caching and
chunked prefill on or off.
"""
from __future__ import annotations

import random

import pytest
import torch

from helpers_spec import GREEDY, PROMPTS, gen_ids, llm_cache, one_thread  # noqa: F401  (fixtures)
from specdecode import LLM, SamplingParams
from specdecode.engine.model_runner import ModelRunner
from specdecode.models.families import FAMILIES as REGISTRY
from specdecode.models.families import family_of
from specdecode.models.loader import load_model
from test_hf_parity import _hf_greedy, _hf_logits, _hf_model, _prompt
from tiny import build_model

FAMILIES = ("gemma2", "gemma3")
# With a float32 KV cache our logits are transformers' up to float32 rounding (about 2e-6 here); the default
# 16-bit cache rounds keys and values, which four layers of these tiny models amplify to about 2e-3.
LOGITS_TOL = 1e-4
N_GREEDY = 32
WINDOW = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("families")
    return {f: build_model(f, root / f, layers=4) for f in FAMILIES}


@pytest.fixture(scope="module")
def hf(models, one_thread):
    memo = {}

    def get(fam):
        if fam not in memo:
            memo[fam] = _hf_model(models[fam])
        return memo[fam]
    return get


@pytest.mark.parametrize("fam", FAMILIES)
def test_config_maps_onto_the_decoder(fam, models):
    import json

    config = json.loads((models[fam] / "config.json").read_text())
    assert family_of(config) == fam
    a = REGISTRY[fam].make_args(config, fam)
    assert a.sliding_window == WINDOW and any(a.sliding_layers) and not all(a.sliding_layers)
    assert a.attn_scale == 24 ** -0.5 and a.embed_scale == 64 ** 0.5 and a.sandwich_norms
    if fam == "gemma2":
        assert (a.attn_softcap, a.final_softcap, a.qk_norm, a.local_rope_theta) == (50.0, 30.0, False, None)
    else:
        assert (a.attn_softcap, a.qk_norm, a.rope_theta, a.local_rope_theta) == (None, True, 1e6, 1e4)
        assert a.rope_scaling["rope_type"] == "linear"
    model = load_model(models[fam], "float32", "cpu", 64, None).model
    assert not model.stack_family()  # the C++ layer stack knows none of this: the Python layers run it


@pytest.mark.parametrize("fam", FAMILIES)
def test_logits_match_transformers(fam, models, hf):
    """Prefill's last row, every row through the verification path, and a prefill of the first half followed by
    the rest as one multi-token decode over the cached half: all transformers' logits."""
    model = hf(fam)
    ids = _prompt(model.config.vocab_size, n=40)  # past the window, over two block boundaries
    want = _hf_logits(model, ids)
    runner = ModelRunner(load_model(models[fam], "float32", "cpu", 256, None), 2, 256, "cpu",
                         kv_cache_dtype="float32")
    last = runner.prefill(0, ids)
    rows = runner.forward_rows([(1, 0, ids)], all_logits=True)[0]
    h = 21
    first = runner.prefill(0, ids[:h])
    split = torch.cat([first[None], runner.forward_rows([(0, h, ids[h:])], all_logits=True)[0]])
    for name, got, ref in (("prefill", last, want[-1]), ("verify rows", rows, want),
                           ("prefill + cached decode", split, want[h - 1:])):
        diff = (got - ref).abs().max().item()
        assert diff < LOGITS_TOL, f"{fam} {name}: max abs logits diff {diff:.2e}"
    assert want.std().item() > 0.1


def _ours(llm, prompts, **kw) -> list[list[int]]:
    return gen_ids(llm, prompts, max_tokens=N_GREEDY, **GREEDY, **kw)


@pytest.mark.parametrize("fam", FAMILIES)
def test_greedy_matches_transformers_plain_speculative_and_batched(fam, models, hf, llm_cache):
    model = hf(fam)
    repeat = [17, 42, 99, 5, 300, 7] * 4  # n-gram drafts find matches in the prompt and in the looping output
    prompts = [_prompt(model.config.vocab_size, n=24, seed=0), repeat] + PROMPTS
    want = [_hf_greedy(model, p, N_GREEDY) for p in prompts]
    plain = llm_cache.get(models[fam], max_model_len=128)
    assert [_ours(plain, [p])[0] for p in prompts] == want
    assert _ours(plain, prompts) == want  # batched with each other
    ngram = llm_cache.get(models[fam], max_model_len=128, speculative_model="[ngram]", num_speculative_tokens=4)
    for batch in ([prompts[1]], prompts):
        outs = ngram.generate(prompt_token_ids=batch, use_tqdm=False,
                              sampling_params=SamplingParams(max_tokens=N_GREEDY, **GREEDY))
        assert [list(o.outputs[0].token_ids) for o in outs] == [want[prompts.index(p)] for p in batch]
        assert sum(o.metrics.spec_decode.num_accepted_tokens for o in outs) > 0


def _run(llm, prompts, max_tokens=12):
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(max_tokens=max_tokens, logprobs=3, **GREEDY))
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("fam", FAMILIES)
def test_prefix_caching_and_chunked_prefill_give_bitwise_the_same_output(fam, models, one_thread):
    """Prompts sharing a 70-token head (4 whole blocks, far past the window): prefilled whole without the
    cache, or in chunks of 32 with the head's blocks from the cache, the token ids and logprobs are bitwise
    the same, also when they arrive together or run under n-gram speculation."""
    rng = random.Random(1)
    head = [rng.randrange(5, 500) for _ in range(70)]
    prompts = [head + [rng.randrange(5, 500) for _ in range(9 + 3 * i)] for i in range(3)]
    kw = dict(model=str(models[fam]), max_model_len=512, seed=0)
    ref_llm = LLM(**kw, enable_prefix_caching=False, max_num_batched_tokens=4096,
                  speculative_config={"method": "none"})
    ref = [_run(ref_llm, [p])[0] for p in prompts]
    llm = LLM(**kw, max_num_batched_tokens=32, speculative_config={"method": "none"})
    got = [_run(llm, [p])[0] for p in prompts]
    pool = llm.llm_engine.pool
    assert pool.hits >= 2 * 64, "the shared head's 4 whole blocks must come from the cache"
    assert got == ref
    assert _run(llm, prompts) == ref  # together, all from the cache
    spec = LLM(**kw, max_num_batched_tokens=32, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert [ids for ids, _ in _run(spec, prompts)] == [ids for ids, _ in ref]
    pool.check_consistency()
    assert pool.num_used_blocks == 0
