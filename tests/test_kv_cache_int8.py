"""The 8-bit KV cache (kv_cache_dtype="int8", alias "q8_0"): int8 values with an fp32 scale per (position, KV
head), one format written and read identically by the Python attention and the C++ layer stack, so every
exactness guarantee of the 16-bit cache holds with it."""
from __future__ import annotations

import random

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.config import EngineConfig
from specdecode.engine.kv_cache import BLOCK_SIZE, KVCache, quantize_int8, resolve_kv_dtype
from specdecode.engine.model_runner import ModelRunner
from specdecode.models.loader import load_model

from helpers_spec import GREEDY, noisy_drafts, one_thread  # noqa: F401  (fixtures)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(path, kv_cache_dtype: str = "int8", slots: int = 3, max_len: int = 128) -> ModelRunner:
    return ModelRunner(load_model(path, "float32", "cpu", max_len, None), slots, max_len, "cpu",
                       kv_cache_dtype=kv_cache_dtype)


def test_names_and_the_error_naming_the_choices():
    for name in ("int8", "q8_0"):
        assert resolve_kv_dtype(name, "cpu", torch.float32) is torch.int8
        assert resolve_kv_dtype(name, "cuda", torch.bfloat16) is torch.int8
        EngineConfig(kv_cache_dtype=name)
    for bad in ("int4", "q4_0", "INT8", 8):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of") as e:
            EngineConfig(kv_cache_dtype=bad)
        msg = str(e.value)
        assert "\n" not in msg and "int8" in msg and "float16" in msg and repr(bad) in msg


def test_write_read_round_trip_within_half_a_step():
    """Each (position, KV head) row comes back within half a quantization step (absmax / 254) of what was
    written, through scattered blocks; an all-zero row comes back as zeros; reads in another dtype are the fp32
    read narrowed; copy_positions carries the scales along."""
    L, KV, D = 2, 3, 32
    kv = KVCache(L, 2, 64, KV, D, torch.int8, "cpu")
    g = torch.Generator().manual_seed(0)
    n = 40
    kv.ensure(1, 16)
    kv.ensure(0, 20)
    kv.ensure(1, n)  # slot 1's blocks are not consecutive: read gathers them through the block table
    # rows of very different magnitudes, as keys of different heads have
    k = torch.randn(n, KV, D, generator=g) * torch.exp(2 * torch.randn(n, KV, 1, generator=g))
    v = torch.randn(n, KV, D, generator=g) * 3
    v[5] = 0.0
    loc = kv.locate(torch.ones(n, dtype=torch.long), torch.arange(n))
    for layer in range(L):
        kv.write(layer, loc, k * (layer + 1), v)
    for layer in range(L):
        k2, v2 = kv.read(layer, 1, n, torch.float32)  # [KV, n, D]
        for want, got in ((k * (layer + 1), k2.transpose(0, 1)), (v, v2.transpose(0, 1))):
            bound = want.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-5)
            assert ((got - want).abs() <= bound).all()
            assert not torch.equal(got, want)  # it did quantize
        assert torch.equal(v2[:, 5], torch.zeros(KV, D))
        kb, vb = kv.read(layer, 1, n, torch.bfloat16)
        assert torch.equal(kb, k2.to(torch.bfloat16)) and torch.equal(vb, v2.to(torch.bfloat16))
    # dequantization is float(q) * scale, the values quantize_int8 gives
    q, s = quantize_int8(v)
    assert torch.equal(kv.read(0, 1, n, torch.float32)[1].transpose(0, 1), q.float() * s[..., None])
    # a partial block copied to another slot's block: values and scales
    src, dst = kv.block_table[1, 1].item(), kv.block_table[0, 0].item()
    kv.copy_positions(src, dst, 5)
    assert torch.equal(kv.read(1, 0, 5, torch.float32)[0], kv.read(1, 1, 21, torch.float32)[0][:, 16:21])


def test_sizes_count_the_scales(tiny_models):
    # The default target's attention shape (28 layers, 2 KV heads of 128): 128 int8 + a 4-byte scale per row.
    kv = KVCache(28, 1, 4096, 2, 128, torch.int8, "cpu")
    assert kv.bytes_per_token == 2 * 28 * 2 * (128 + 4) == 14784  # float16: 28672
    assert kv.nbytes == 4096 * kv.bytes_per_token
    assert "14784 B/token" in repr(kv)
    r = _runner(tiny_models["qwen3"])
    a = r.model.args
    per_block = KVCache.block_bytes(r.model, "int8", "cpu")
    assert per_block == 2 * a.num_layers * a.num_kv_heads * BLOCK_SIZE * (a.head_dim + 4)
    assert per_block == BLOCK_SIZE * r.kv_cache.bytes_per_token
    assert r.kv_cache.nbytes == r.kv_cache.num_blocks * per_block
    assert KVCache.block_bytes(r.model, "q8_0", "cpu") == per_block < KVCache.block_bytes(r.model, "auto", "cpu")


def test_stack_stores_what_the_python_path_stores(tiny_models, one_thread):
    """Rows the C++ stack writes hold quantize_int8 of the exact (fp32 cache) keys and values, byte for byte
    with their scales, and the stack's logits match the Python layers' over the int8 cache."""
    ids = _prompt(40, 5)
    st = {}
    for dt in ("float32", "int8"):
        r = _runner(tiny_models["llama"], dt)
        assert r.model._layer_stack() is not None
        r.prefill(0, ids[:16])
        r.forward_rows([(0, 16, ids[16:24])], all_logits=True)  # positions 16..23 written by decode rows
        st[dt] = r.kv_cache
    c8 = st["int8"]
    blk = c8.block_table[0, 1].item()
    k32, v32 = st["float32"].read(0, 0, 24, torch.float32)  # layer 0 sees the same input with either cache
    qk, sk = quantize_int8(k32.transpose(0, 1)[16:24])
    qv, sv = quantize_int8(v32.transpose(0, 1)[16:24])
    keys, values = c8.layer(0)
    ks, vs = c8.scales(0)
    assert torch.equal(keys[blk, :, :, :8].permute(2, 0, 1), qk) and torch.equal(ks[blk, :, :8].T, sk)
    assert torch.equal(values[blk, :, :8].permute(1, 0, 2), qv) and torch.equal(vs[blk, :, :8].T, sv)
    out = {}
    for fused in (True, False):
        r = _runner(tiny_models["qwen3"])
        r.model.fused_layers = fused
        r.prefill(0, ids[:20])
        verified = r.forward_rows([(0, 20, ids[20:30])], all_logits=True)[0]
        decoded = [r.forward_rows([(0, 30 + i, [t])], all_logits=True)[0] for i, t in enumerate(ids[30:])]
        out[fused] = torch.cat([verified, *decoded])
    assert (out[True] - out[False]).abs().max().item() < 1e-4


@pytest.mark.parametrize("fam", ["qwen2", "opt"])
def test_a_token_has_the_same_logits_alone_batched_and_verified(fam, tiny_models, one_thread):
    """C++ stack (qwen2) and Python attention (opt): rows decoded one at a time, verified together, and verified
    between another request's rows give bitwise the same logits over the int8 cache."""
    ids, other = _prompt(30, 4), _prompt(40, 6)

    def run(mode: str) -> torch.Tensor:
        r = _runner(tiny_models[fam])
        r.prefill(1, ids[:20])
        r.prefill(2, other[:30])
        if mode == "alone":
            return torch.cat([r.forward_rows([(1, 20 + i, [t])], all_logits=True)[0] for i, t in enumerate(ids[20:])])
        if mode == "verified":
            return r.forward_rows([(1, 20, ids[20:])], all_logits=True)[0]
        return r.forward_rows([(2, 30, other[30:33]), (1, 20, ids[20:]), (2, 33, other[33:35])], all_logits=True)[1]

    alone = run("alone")
    assert torch.equal(alone, run("verified")) and torch.equal(alone, run("batched"))


def _prompts() -> list[list[int]]:
    """A shared 40-token head (2 whole blocks and 8 positions) with different tails, and a repetitive prompt
    for the n-gram proposer."""
    rng = random.Random(3)
    head = [rng.randrange(5, 500) for _ in range(40)]
    return [head + [rng.randrange(5, 500) for _ in range(5 + 4 * i)] for i in range(2)] + [[17, 42, 99] * 6]


def _outputs(llm, prompts: list[list[int]], one_by_one: bool) -> list:
    params = SamplingParams(max_tokens=16, logprobs=2, **GREEDY)
    groups = [[p] for p in prompts] if one_by_one else [prompts]
    return [o for g in groups for o in llm.generate(prompt_token_ids=g, sampling_params=params, use_tqdm=False)]


def _run(llm, prompts: list[list[int]], one_by_one: bool) -> list:
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in _outputs(llm, prompts, one_by_one)]


@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_speculative_greedy_equals_plain_with_prefix_caching_and_chunks(fam, tiny_models, noisy_drafts, one_thread):
    """Greedy with the int8 cache (C++ stack for llama, Python attention for gpt2): plain decoding without
    prefix caching or chunked prefill is the reference; plain decoding with both (prompts one after another, so
    the shared head comes from the cache), n-gram and draft-model speculation (k = 4; the draft a noisy copy
    of the target, so it is accepted in part and both caches roll back) with and without them all give the
    same tokens (and, without speculation, bitwise the same logprobs)."""
    prompts = _prompts()

    def llm(prefix: bool, **kw) -> LLM:
        return LLM(str(tiny_models[fam]), max_model_len=256, kv_cache_dtype="int8", seed=0,
                   enable_prefix_caching=prefix, max_num_batched_tokens=32 if prefix else 4096, **kw)

    ref_llm = llm(False, speculative_config={"method": "none"})
    assert ref_llm.llm_engine.target.kv_cache.dtype is torch.int8
    ref = _run(ref_llm, prompts, one_by_one=True)
    assert _run(ref_llm, prompts, one_by_one=False) == ref
    del ref_llm
    cached = llm(True, speculative_config={"method": "none"})
    assert _run(cached, prompts, one_by_one=True) == ref
    assert cached.llm_engine.pool.hits >= 32
    del cached
    want = [ids for ids, _ in ref]
    for spec in ("[ngram]", str(noisy_drafts[fam])):
        for prefix in (True, False):
            s = llm(prefix, speculative_model=spec, num_speculative_tokens=4)
            assert s.llm_engine.target.kv_cache.dtype is torch.int8
            drafted = accepted = 0
            for one_by_one in (True, False):
                outs = _outputs(s, prompts, one_by_one)
                assert [list(o.outputs[0].token_ids) for o in outs] == want, (spec, prefix, one_by_one)
                drafted += sum(o.metrics.spec_decode.num_draft_tokens for o in outs)
                accepted += sum(o.metrics.spec_decode.num_accepted_tokens for o in outs)
            assert 0 < accepted, "nothing accepted: the test would prove little"
            if spec != "[ngram]":
                assert accepted < drafted, "no draft rejected: no rollback tested"
                assert s.llm_engine.draft_runner.kv_cache.dtype is torch.int8
            del s
