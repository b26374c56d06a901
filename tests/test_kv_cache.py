"""The KV cache object (engine/kv_cache.py): 16-bit storage with one key layout, lazily resident memory, the
block table every reader and writer goes through, rollback as a length change, and the exactness guarantees
on every supported cache dtype."""
from __future__ import annotations

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.config import EngineConfig
from specdecode.engine.kv_cache import BLOCK_SIZE, KVCache, resolve_kv_dtype
from specdecode.engine.model_runner import ModelRunner
from specdecode.models.loader import load_model

from helpers_spec import edit_config, one_thread  # noqa: F401  (fixture)
from tiny import build_model


def _prompt(n: int, seed: int, hi: int = 500) -> list[int]:
    return torch.randint(5, hi, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _runner(path, kv_cache_dtype: str = "auto", slots: int = 3, max_len: int = 128) -> ModelRunner:
    return ModelRunner(load_model(path, "float32", "cpu", max_len, None), slots, max_len, "cpu",
                       kv_cache_dtype=kv_cache_dtype)


def _resident_bytes(t: torch.Tensor) -> int:
    """Resident bytes of the memory mapping that holds tensor t (from /proc/self/smaps)."""
    addr, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


def test_dtype_names():
    assert resolve_kv_dtype("auto", "cpu", torch.float32) == torch.float16
    assert resolve_kv_dtype("auto", "cuda", torch.bfloat16) == torch.bfloat16  # the model dtype off CPU
    for name, want in (("fp16", torch.float16), ("float16", torch.float16), ("bfloat16", torch.bfloat16),
                       ("float32", torch.float32)):
        assert resolve_kv_dtype(name, "cpu", torch.float32) == want
    for bad in ("fp8", "int4", 16, None, ["float16"]):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of") as e:
            EngineConfig(kv_cache_dtype=bad)
        assert "\n" not in str(e.value)
    assert "not implemented" in str(pytest.raises(ValueError, EngineConfig, kv_cache_dtype="fp8_e4m3").value)


def test_draft_sized_cache_at_4k_is_16_bit_one_key_copy_and_resident_only_where_written(tmp_path, one_thread):
    """A model with the default draft's attention shape (24 layers, 2 KV heads of 64; Qwen2.5-Coder-0.5B) at
    1 slot and 4096 positions: keys and values once each, 2 bytes per element, and only the written blocks
    resident."""
    path = build_model("qwen2", tmp_path / "draft_sized", layers=24, hidden=256)  # 4 heads of 64, 2 KV heads
    edit_config(path, max_position_embeddings=32768)  # the real draft's context, so that 4096 positions fit
    r = _runner(path, slots=1, max_len=4096)
    kv = r.kv_cache
    assert (kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype) == (24, 2, 64, torch.float16)
    per_token = 24 * 2 * 64 * 2 * 2  # layers x KV heads x head_dim x (keys + values) x 2 bytes
    assert kv.bytes_per_token == per_token == 12288
    assert kv.nbytes == 4096 * per_token  # 48 MiB reserved; the fp32 cache with its key copy took 3x per token
    assert r.model._layer_stack() is not None
    storage = kv.layer(0)[0]
    assert _resident_bytes(storage) == 0  # nothing written yet
    upper = kv.nbytes if _thp_always() else None
    r.prefill(0, _prompt(1000, 0))
    blocks = -(-1000 // BLOCK_SIZE)
    want = blocks * BLOCK_SIZE * per_token  # a block of this shape is exactly one 4 KiB page per layer and K/V
    got = _resident_bytes(storage)
    assert got == want if upper is None else want <= got <= upper
    # Decode rows (the C++ stack) up to the next block: one more block per layer and K/V becomes resident.
    pos = 1000
    while pos <= blocks * BLOCK_SIZE:
        r.forward_rows([(0, pos, [7])], all_logits=False)
        pos += 1
    want += BLOCK_SIZE * per_token
    got = _resident_bytes(storage)
    assert got == want if upper is None else want <= got <= upper


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16", "float32"])
def test_rollback_is_a_length_change(kv_cache_dtype, tiny_models, one_thread):
    """Rejected drafts leave stale positions behind; writing past the accepted length again gives the logits of
    a cache that never saw them (both paths: C++ stack for qwen2, Python attention for opt)."""
    ids, drafts = _prompt(40, 1), _prompt(6, 2)
    for fam in ("qwen2", "opt"):
        r = _runner(tiny_models[fam], kv_cache_dtype)
        r.prefill(0, ids[:30])
        r.forward_rows([(0, 30, drafts)], all_logits=True)  # written, then rejected from position 32 on
        r.forward_rows([(0, 30, drafts[:2])], all_logits=True)
        got = r.forward_rows([(0, 32, ids[32:40])], all_logits=True)[0]
        fresh = _runner(tiny_models[fam], kv_cache_dtype)
        fresh.prefill(0, ids[:30])
        fresh.forward_rows([(0, 30, drafts[:2])], all_logits=True)
        want = fresh.forward_rows([(0, 32, ids[32:40])], all_logits=True)[0]
        assert torch.equal(got, want), fam


@pytest.mark.parametrize("fam", ["qwen2", "opt"])
def test_block_table_is_the_only_address(fam, tiny_models, one_thread):
    """Readers and writers (the C++ stack for qwen2, the Python attention for opt and for prefill) find
    positions only through the block table: scattering a slot's blocks over the pool, as a paged allocator
    will, changes no logit."""
    ids = _prompt(50, 3)
    out = []
    for scatter in (False, True):
        r = _runner(tiny_models[fam])
        if scatter:
            g = torch.Generator().manual_seed(0)
            r.kv_cache.block_table.copy_(torch.randperm(r.kv_cache.num_blocks, generator=g).view_as(r.kv_cache.block_table))
        first = r.prefill(1, ids[:33])
        rows = r.forward_rows([(1, 33, ids[33:38]), (2, 0, ids[:4])], all_logits=True)
        out.append((first, *rows))
    assert all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("fam", ["opt", "gpt2", "llama"])
def test_python_attention_rows_are_invariant(fam, tiny_models, one_thread):
    """Decode / verification rows on the Python attention path over the 16-bit cache: a row decoded alone has
    bitwise the logits it has verified next to its drafts and another request's rows."""
    ids, other = _prompt(30, 4), _prompt(40, 5)

    def run(mode: str) -> torch.Tensor:
        r = _runner(tiny_models[fam])
        r.model.fused_layers = False  # llama: the Python layers instead of the C++ stack
        r.prefill(1, ids[:20])
        r.prefill(2, other[:30])
        if mode == "alone":
            return torch.cat([r.forward_rows([(1, 20 + i, [t])], all_logits=True)[0] for i, t in enumerate(ids[20:])])
        return r.forward_rows([(2, 30, other[30:33]), (1, 20, ids[20:]), (2, 33, other[33:35])], all_logits=True)[1]

    assert torch.equal(run("alone"), run("batched"))


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float32"])
def test_speculative_greedy_equals_plain_on_other_cache_dtypes(kv_cache_dtype, tiny_models, tiny_draft, one_thread):
    """tests/test_exactness.py covers the default ("auto", 16-bit) cache; the other dtypes keep the guarantee."""
    prompts = [[17, 42, 99, 17, 42, 99, 17, 42], [300, 301, 302, 5, 6, 7, 300, 301]]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for fam in ("qwen2", "gpt2"):
        plain = LLM(str(tiny_models[fam]), max_model_len=128, kv_cache_dtype=kv_cache_dtype)
        want = [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                use_tqdm=False)]
        assert plain.engine.target.kv_cache.dtype == getattr(torch, kv_cache_dtype)
        del plain
        for spec in ("[ngram]", str(tiny_draft)):
            llm = LLM(str(tiny_models[fam]), max_model_len=128, kv_cache_dtype=kv_cache_dtype,
                      speculative_model=spec, num_speculative_tokens=3)
            got = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                 use_tqdm=False)]
            assert got == want, (fam, spec)


def test_16_bit_cache_stays_close_to_fp32(tiny_models, one_thread):
    """The 16-bit caches only round stored keys and values: logits stay near the fp32 cache's, float16
    (10-bit mantissa) nearer than bfloat16 (7-bit)."""
    ids = _prompt(60, 6)
    logits = {}
    for dt in ("float32", "float16", "bfloat16"):
        r = _runner(tiny_models["qwen2"], dt)
        r.prefill(0, ids[:40])
        logits[dt] = r.forward_rows([(0, 40, ids[40:])], all_logits=True)[0]
    d16 = (logits["float16"] - logits["float32"]).abs().max().item()
    dbf = (logits["bfloat16"] - logits["float32"]).abs().max().item()
    assert 0 < d16 < dbf < 0.1, (d16, dbf)
    assert torch.equal(logits["float16"].argmax(-1), logits["float32"].argmax(-1))


def test_cache_is_freed_with_its_runner(tiny_models):
    import gc
    import weakref

    r = _runner(tiny_models["llama"], slots=2, max_len=1024)
    ref = weakref.ref(r.kv_cache)
    r.prefill(0, _prompt(20, 7))
    del r
    gc.collect()
    assert ref() is None


def test_kv_cache_repr_and_sizes():
    kv = KVCache(num_layers=28, num_slots=1, max_model_len=4096, num_kv_heads=2, head_dim=128,
                 dtype=torch.float16, device="cpu")  # the default target's attention shape
    assert kv.bytes_per_token == 28672 and kv.nbytes == 4096 * 28672
    assert "28672 B/token" in repr(kv)
    with pytest.raises(ValueError, match="not supported on CPU"):
        KVCache(1, 1, 16, 1, 8, torch.int16, "cpu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_repeat_copies_whole_blocks_and_discard_gives_the_memory_back(dtype):
    """calibration.py times passes after a long context made by repeating a prefilled one; the memory it took
    goes back to the system afterwards (a shared anonymous map: MADV_REMOVE, or its pages would stay)."""
    kv = KVCache(4, 2, 32768, 2, 64, dtype, "cpu")
    kv.ensure(1, 40)  # another slot's blocks must come through untouched
    kv.ensure(0, 2 * BLOCK_SIZE)
    gen = torch.Generator().manual_seed(0)
    for i in range(4):
        for t in kv.layer(i):
            t[:3] = torch.randint(-100, 100, t[:3].shape, generator=gen).to(dtype)
    other = [t[2].clone() for i in range(4) for t in kv.layer(i)]
    kv.repeat(0, 2 * BLOCK_SIZE + 5, 30000)  # two whole blocks computed (the partial third is not copied)
    blocks = kv.pool.blocks(0)
    assert len(blocks) == -(-30000 // BLOCK_SIZE)
    for i in range(4):
        for t in kv.layer(i):
            assert torch.equal(t[blocks], t[[blocks[j % 2] for j in range(len(blocks))]])
    assert all(torch.equal(t[2], o) for t, o in zip((t for i in range(4) for t in kv.layer(i)), other))

    def shmem_kb() -> int:  # this process's resident shared memory (the cache's map)
        return int(open("/proc/self/status").read().split("RssShmem:")[1].split()[0])

    before = shmem_kb()
    kv.discard(0)
    assert before - shmem_kb() > 0.5 * len(blocks) * kv.bytes_per_token * BLOCK_SIZE / 1024
    assert all(not t[blocks[2:-2]].any() for i in range(4) for t in kv.layer(i))  # (reading takes pages again)
    assert all(torch.equal(t[2], o) for t, o in zip((t for i in range(4) for t in kv.layer(i)), other))
    with pytest.raises(ValueError, match="whole block"):
        kv.repeat(1, BLOCK_SIZE - 1, 100)
