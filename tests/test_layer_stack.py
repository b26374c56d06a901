"""The C++ decoder-layer stack (kernels.LayerStack) that decode and verification rows take for llama-style
models: it computes what the Python layers compute, and a row's logits never depend on the other rows, the
row count or the thread count (the basis of greedy exactness)."""
from __future__ import annotations

import pytest
import torch

from specdecode.engine.model_runner import ModelRunner
from specdecode.layers import kernels
from specdecode.models.loader import load_model

STACK_FAMILIES = ("llama", "qwen2", "qwen3")


def _runner(path, quantization=None, kv_cache_dtype: str = "auto") -> ModelRunner:
    return ModelRunner(load_model(path, "float32", "cpu", 128, quantization), 3, 128, "cpu",
                       kv_cache_dtype=kv_cache_dtype)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_stack_applies_to_llama_style_models_only(tiny_models):
    for fam, path in tiny_models.items():
        r = _runner(path)
        assert (r.model._layer_stack() is not None) == (fam in STACK_FAMILIES), fam
    r = _runner(tiny_models["llama"])
    r.model.fused_layers = False
    assert r.model._layer_stack() is None


@pytest.mark.parametrize("quantization", [None, "int8", "w8a8", "w4a8"])
@pytest.mark.parametrize("fam", STACK_FAMILIES)
def test_stack_matches_python_layers(fam, quantization, tiny_models):
    """Verification rows over a cached prefix: the stack against the Python layers, same weights."""
    ids = _prompt(30, 1)
    out = {}
    for fused in (True, False):
        r = _runner(tiny_models[fam], quantization)
        r.model.fused_layers = fused
        r.prefill(0, ids[:20])
        out[fused] = r.forward_rows([(0, 20, ids[20:])], all_logits=True)[0]
    # Quantized activations can round one step apart when the inputs differ in the last bits.
    tol = 1e-4 if quantization in (None, "int8") else 5e-2
    diff = (out[True] - out[False]).abs().max().item()
    assert diff < tol, f"{fam} {quantization}: max abs diff {diff:.2e}"
    assert out[True].std().item() > 0.1
    assert torch.equal(out[True].argmax(-1), out[False].argmax(-1))


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16"])
def test_stack_matches_python_layers_on_other_cache_dtypes(kv_cache_dtype, tiny_models):
    """The stack reads and writes each cache dtype as the Python attention does (the default float16 is
    covered above)."""
    ids = _prompt(40, 4)
    out = {}
    for fused in (True, False):
        r = _runner(tiny_models["qwen3"], kv_cache_dtype=kv_cache_dtype)
        assert r.kv_cache.dtype == getattr(torch, kv_cache_dtype)
        r.model.fused_layers = fused
        r.prefill(0, ids[:20])
        verified = r.forward_rows([(0, 20, ids[20:30])], all_logits=True)[0]
        decoded = [r.forward_rows([(0, 30 + i, [t])], all_logits=True)[0] for i, t in enumerate(ids[30:])]
        out[fused] = torch.cat([verified, *decoded])
    diff = (out[True] - out[False]).abs().max().item()
    assert diff < 1e-4, f"{kv_cache_dtype}: max abs diff {diff:.2e}"


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_stack_rounds_keys_and_values_as_torch_does(kv_cache_dtype, tiny_models):
    """What the stack stores for a row is torch's rounding of the fp32 key / value: a run with an fp32 cache
    gives the exact values (the first layer sees the same input either way), narrowed by torch they must equal
    the 16-bit cache's bits, so the Python path and the stack agree on every stored value."""
    ids = _prompt(24, 5)
    stored = {}
    for dt in ("float32", kv_cache_dtype):
        r = _runner(tiny_models["llama"], kv_cache_dtype=dt)
        r.prefill(0, ids[:16])
        r.forward_rows([(0, 16, ids[16:])], all_logits=True)  # positions 16..23 written by the stack
        stored[dt] = r.kv_cache.read(0, 0, 24, torch.float32)
    dtype = getattr(torch, kv_cache_dtype)
    for exact, narrow in zip(stored["float32"], stored[kv_cache_dtype]):
        assert torch.equal(exact[:, 16:].to(dtype).float(), narrow[:, 16:])
        assert not torch.equal(exact[:, 16:], narrow[:, 16:])  # it did round


@pytest.mark.parametrize("quantization", [None, "w8a8", "w4a8"])
def test_stack_rows_are_invariant(quantization, tiny_models):
    """One request's rows decoded one at a time, verified together, and verified next to other requests'
    rows on another thread count: bitwise the same logits and (16-bit) KV cache."""
    ids, other = _prompt(24, 2), _prompt(40, 3)

    def run(mode: str, threads: int):
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            r = _runner(tiny_models["qwen2"], quantization)
            assert r.model._layer_stack() is not None
            r.prefill(1, ids[:16])
            r.prefill(2, other[:30])
            if mode == "one by one":
                rows = torch.cat([r.forward_rows([(1, 16 + i, [t])], all_logits=True)[0]
                                  for i, t in enumerate(ids[16:])])
            elif mode == "together":
                rows = r.forward_rows([(1, 16, ids[16:])], all_logits=True)[0]
            else:  # between another request's rows
                rows = r.forward_rows([(2, 30, other[30:34]), (1, 16, ids[16:]), (2, 34, other[34:36])],
                                      all_logits=True)[1]
            cache = r.kv_cache
            assert cache.dtype == torch.float16  # "auto" on CPU: the stack reads the 16-bit cache directly
            kv = [cache.read(i, 1, 24, torch.float32) for i in range(cache.num_layers)]
            return rows, kv
        finally:
            torch.set_num_threads(prev)

    ref_rows, ref_kv = run("one by one", 1)
    for mode, threads in (("together", 1), ("mixed", 2), ("together", 2)):
        rows, kv = run(mode, threads)
        assert torch.equal(rows, ref_rows), f"{mode} on {threads} threads"
        assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(kv, ref_kv)), mode


def test_stack_rejects_bad_input(tiny_models):
    r = _runner(tiny_models["llama"])
    stack = r.model._layer_stack()
    x = torch.zeros(2, r.model.args.hidden_size)
    with pytest.raises(ValueError, match="position or slot out of range"):
        stack(x, torch.tensor([0, 128]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="position or slot out of range"):
        stack(x, torch.tensor([0, 1]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"\[M, hidden\]"):
        stack(torch.zeros(2, 3), torch.tensor([0, 1]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="float32"):
        stack(x.double(), torch.tensor([0, 1]), torch.tensor([0, 0]))
    table = r.kv_cache.block_table
    saved = table[1, 2].item()
    table[1, 2] = r.kv_cache.num_blocks  # a paged table with a bad entry is caught, not followed
    try:
        with pytest.raises(ValueError, match="block table entry out of range"):
            stack(x, torch.tensor([40, 41]), torch.tensor([1, 1]))
    finally:
        table[1, 2] = saved
    assert kernels.kernel_available()


def test_prompt_rows_take_the_stack_so_any_split_and_decoded_blocks_are_bitwise_prefill(tmp_path):
    """On the default target's real layer sizes (its first 3 layers, sliced), a prompt prefilled whole, in chunks
    that start inside a block, several prompts in one pass, or with its last tokens fed as decode rows: bitwise
    the same logits and KV cache. So a prefix-cache hit on blocks that decoding wrote (a chat's previous answer)
    or on part of a block gives what a cold prefill gives."""
    from test_gguf_loader import draft_path, slice_gguf  # noqa: F401  (draft_path: skips without the models)

    from specdecode.models.default_models import default_model_path

    path = slice_gguf(default_model_path("target"), tmp_path / "target.gguf", layers=3, vocab=2048)
    runner = ModelRunner(load_model(path, "auto", "cpu", 256, "mixed", packed_cache=False), 4, 256, "cpu")
    assert runner.model._layer_stack() is not None
    ids, other = _prompt(150, 7), _prompt(40, 8)
    whole = runner.prefill(0, ids)
    runner.prefill(1, ids[:37])
    runner.prefill(1, ids[37:146], 37)
    split = runner.prefill_many([(3, 0, other), (1, 146, ids[146:])])[1]
    runner.prefill(2, ids[:149])
    decoded = runner.forward_rows([(2, 149, ids[149:])], all_logits=False)[0][0]
    assert torch.equal(whole, split) and torch.equal(whole, decoded)
    cache = runner.kv_cache
    for layer in range(cache.num_layers):
        ref = cache.read(layer, 0, 150, torch.float32)
        for slot in (1, 2):
            got = cache.read(layer, slot, 150, torch.float32)
            assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), (layer, slot)


def test_a_long_prompts_attention_in_pieces_gives_each_row_its_decode_result(tiny_models):
    """A long prompt's query rows are cut into pieces whose scores stay in cache, and score tiles past a row's
    own position are skipped. 600 positions with 2 query heads per KV head make 1,200 query rows against 600
    keys: several pieces, each boundary inside the prompt. Every row's logits and the KV cache must be bitwise
    what feeding the same tokens one decode row at a time gives."""
    n = 600
    ids = _prompt(n, 11)
    r = ModelRunner(load_model(tiny_models["qwen2"], "float32", "cpu", 1024, None), 2, 1024, "cpu")
    assert r.model._layer_stack() is not None
    whole = r.forward_rows([(0, 0, ids)], all_logits=True)[0]
    one_by_one = torch.cat([r.forward_rows([(1, p, [ids[p]])], all_logits=True)[0] for p in range(n)])
    assert whole.shape == one_by_one.shape == (n, r.vocab_size)
    assert torch.equal(whole, one_by_one)
    assert whole[-1].std().item() > 0.01  # the rows carry signal, not a constant
    for layer in range(r.kv_cache.num_layers):
        a, b = r.kv_cache.read(layer, 0, n, torch.float32), r.kv_cache.read(layer, 1, n, torch.float32)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), layer
