"""GGUF tensor types: every type the gguf package decodes loads, exactly as gguf decodes it, and runs with the same
greedy tokens with and without speculation; Q8_0 runs natively (its blocks as stored, in the q8_0 kernel format);
a type nothing decodes is refused in one line naming the tensor and the type."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from helpers_families import add_gpt2_vocab
from helpers_spec import GREEDY, PROMPTS
from specdecode import LLM, SamplingParams
from specdecode.layers import kernels
from specdecode.layers.linear import Linear
from specdecode.models.gguf_loader import decodable, read_gguf
from specdecode.models.loader import load_model
from tiny import build_model

_VALUES = {T.I8: np.int8, T.I16: np.int16, T.I32: np.int32, T.I64: np.int64, T.F64: np.float64}


def _quantizable(t: T) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, GGML_QUANT_SIZES[t][0]), dtype=np.float32), t)
    except NotImplementedError:
        return False
    return True


# Every type in the installed gguf package with a defined block size that it (or the loader, for plain values) decodes.
TYPES = [t for t in T if t in GGML_QUANT_SIZES and decodable(int(t))]
UNDECODABLE = [t for t in T if t in GGML_QUANT_SIZES and not decodable(int(t))]


def _encode(w: np.ndarray, t: T, rng: np.random.Generator) -> np.ndarray:
    """A float32 [rows, K] weight in type ``t``: quantized by gguf where it can, plain values cast for the integer
    types, else random blocks (bytes with bit 6 clear, so that every fp16 field is finite and below 2)."""
    if t in _VALUES:
        return (np.round(w * 4) if t != T.F64 else w).astype(_VALUES[t])
    if _quantizable(t):
        return gguf.quants.quantize(w, t)
    block, size = GGML_QUANT_SIZES[t]
    return rng.integers(0, 256, (w.shape[0], w.shape[1] // block * size), dtype=np.uint8) & 0xBF


def write_typed_gguf(hf_dir: Path, path: Path, kind: T | list[T]) -> dict[str, np.ndarray]:
    """The tiny Qwen2 model of ``hf_dir`` as a GGUF file whose matrices are stored as ``kind`` (one type, or a list
    cycled over the matrices); vectors stay F32 as llama.cpp keeps them. Returns gguf's own decoding of each matrix
    (gguf names, float32 in GGUF's [rows, K] order)."""
    from safetensors.torch import load_file

    c = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in (("context_length", c["max_position_embeddings"]), ("embedding_length", c["hidden_size"]),
                       ("block_count", c["num_hidden_layers"]), ("feed_forward_length", c["intermediate_size"]),
                       ("attention.head_count", c["num_attention_heads"]),
                       ("attention.head_count_kv", c["num_key_value_heads"]), ("vocab_size", c["vocab_size"])):
        w.add_uint32(f"qwen2.{key}", value)
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_float32("qwen2.rope.freq_base", c.get("rope_theta", 10000.0))
    add_gpt2_vocab(w, hf_dir)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN2, c["num_hidden_layers"])
    kinds = kind if isinstance(kind, list) else [kind]
    rng = np.random.default_rng(0)
    decoded: dict[str, np.ndarray] = {}
    i = 0
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        gname = f"{names.get_name(base)}.{suffix}"
        if t.dim() == 1:
            w.add_tensor(gname, t.float().numpy())
            continue
        qt = kinds[i % len(kinds)]
        i += 1
        data = _encode(t.float().numpy(), qt, rng)
        if qt in _VALUES:
            w.add_tensor(gname, data)
            decoded[gname] = data.astype(np.float32)
        else:
            w.add_tensor(gname, data, raw_dtype=qt)
            if decodable(int(qt)):
                decoded[gname] = gguf.quants.dequantize(data, qt).reshape(t.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    # hidden 256: every row holds whole blocks of every type (256 weights for the K-quants and i-quants)
    return build_model("qwen2", tmp_path_factory.mktemp("types") / "hf", layers=2, hidden=256)


def _spec_check(path: Path) -> int:
    """Greedy tokens of the default (mixed) engine, alone and batched, equal those under n-gram speculation
    (k = 4); returns the number of drafted tokens."""
    prompts = [[17, 42, 99, 5, 300, 7] * 4] + PROMPTS
    params = SamplingParams(max_tokens=16, **GREEDY)
    plain = LLM(str(path), max_model_len=128, speculative_config={"method": "none"})
    want = [list(o.outputs[0].token_ids) for o in plain.generate(prompt_token_ids=prompts, sampling_params=params,
                                                                  use_tqdm=False)]
    spec = LLM(str(path), max_model_len=128, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    outs = spec.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    return sum(o.metrics.spec_decode.num_draft_tokens for o in outs)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_decodable_type_loads_as_gguf_decodes_it(qtype, hf_dir, tmp_path):
    """A file whose matrices all have one type: each tensor reads back as gguf's own decoding, the float32 model
    holds exactly those weights, and the default (quantized) model loads and runs."""
    path = tmp_path / f"{qtype.name}.gguf"
    decoded = write_typed_gguf(hf_dir, path, qtype)
    g = read_gguf(path)
    hf_of = {g._ref(hf).gguf_name: hf for hf in g.tensor_names()}
    for name, want in decoded.items():
        assert g.tensor_type(hf_of[name]) == qtype.name
        assert torch.equal(g.load_tensor(hf_of[name]), torch.from_numpy(want)), name
    g.close()
    model = load_model(path, "float32", "cpu", 64, "none", packed_cache=False).model
    gate_up = torch.cat([torch.from_numpy(decoded[f"blk.0.{n}.weight"]) for n in ("ffn_gate", "ffn_up")])
    assert torch.equal(model.layers[0].gate_up_proj.weight, gate_up)
    assert torch.equal(model.embed_tokens.weight, torch.from_numpy(decoded["token_embd.weight"]))


def test_all_types_in_one_file_run_the_same_with_and_without_speculation(tmp_path):
    """Every decodable type at once, one or two matrices each (fused projections then mix types, so they take
    w8a8): greedy tokens under n-gram speculation equal plain decoding's."""
    layers = -(-(len(TYPES) - 1) // 7)  # 7 matrices a layer, and the (tied) embedding table
    hf = build_model("qwen2", tmp_path / "hf", layers=layers, hidden=256)
    path = tmp_path / "all.gguf"
    write_typed_gguf(hf, path, TYPES)
    g = read_gguf(path)
    assert {g.tensor_type(n) for n in g.tensor_names()} >= {t.name for t in TYPES}
    g.close()
    assert _spec_check(path) > 0


def test_a_type_gguf_cannot_decode_is_refused_in_one_line(hf_dir, tmp_path):
    assert UNDECODABLE, "the installed gguf package decodes every type: nothing to refuse"
    qtype = UNDECODABLE[0]
    path = tmp_path / "bad.gguf"
    write_typed_gguf(hf_dir, path, [T.F32, qtype])
    with pytest.raises(ValueError) as e:
        read_gguf(path)
    msg = str(e.value)
    assert "\n" not in msg and qtype.name in msg and "tensor " in msg and ".weight" in msg


# ------------------------------------------------------------------------------------------------ Q8_0, natively
_PARTS = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",), "gate_up_proj": ("ffn_gate", "ffn_up"),
          "down_proj": ("ffn_down",)}


def test_q8_0_blocks_go_to_the_integer_kernel_as_stored(hf_dir, tmp_path, monkeypatch):
    """Under the default "mixed" quantization every linear of a Q8_0 file is q8_0 holding exactly gguf's decoding
    of its blocks (the fused ones: their parts' rows in order; the tied head: the embedding's blocks), and no
    float weight is quantized on the way: a q8_0 packing of floats would fail here."""
    from specdecode.layers.kernels import packed as packed_mod

    path = tmp_path / "q8.gguf"
    decoded = write_typed_gguf(hf_dir, path, T.Q8_0)

    def no_requantization(w):
        raise AssertionError("a Q8_0 weight was requantized")
    monkeypatch.setattr(packed_mod, "_quantize_q8", no_requantization)
    model = load_model(path, "auto", "cpu", 64, "mixed", packed_cache=False).model
    for i, layer in enumerate(model.layers):
        for name, parts in _PARTS.items():
            p = getattr(layer, name).packed
            assert p.fmt == "q8_0", (i, name)
            want = torch.cat([torch.from_numpy(decoded[f"blk.{i}.{part}.weight"]) for part in parts])
            assert torch.equal(kernels.dequantize(p), want), (i, name)
    assert model.lm_head.packed.fmt == "q8_0"
    assert torch.equal(kernels.dequantize(model.lm_head.packed), torch.from_numpy(decoded["token_embd.weight"]))
    assert all(m.packed.fmt == "q8_0" for m in model.modules() if isinstance(m, Linear))


def test_q8_0_kernel_matches_gguf_dequantization(hf_dir):
    """The kernel on stored Q8_0 blocks (any int8 value, -128 included) against gguf's dequantization of the same
    blocks: exact but for float rounding given the activations it quantizes, and within the activation
    quantization error of w8a8 of the float product; each row bitwise independent of the others, also on the
    pure-torch path (the CUDA path takes its dequantized weight too)."""
    from test_kernels import _assert_row_invariant, _rel_err, forced_fallback, q8_0_blocks

    for n, k in ((131, 1536), (40, 4096)):
        blocks = q8_0_blocks(n, k, n)
        p = kernels.pack_q8_0(blocks, k)
        w = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), T.Q8_0).copy())
        assert torch.equal(kernels.dequantize(p), w)
        x, bias = torch.randn(9, k) * 3, torch.randn(n)
        out = kernels.rowinv_linear(x, p, bias)
        assert _rel_err(out, F.linear(kernels.quantize_activations(x), w, bias)) < 1e-5
        assert _rel_err(out, F.linear(x, w, bias)) < 3e-2
        _assert_row_invariant(p, bias, k, seed=k)
        with forced_fallback():
            assert _rel_err(kernels.rowinv_linear(x, p, bias), out) < 1e-5
            _assert_row_invariant(p, bias, k, seed=k)
        rows = torch.tensor([7, 0, n - 1, 3])
        assert torch.equal(kernels.dequantize(p.select_rows(rows)), w[rows])
        assert torch.equal(kernels.rowinv_linear(x, p.select_rows(rows)), kernels.rowinv_linear(x, p)[:, rows])
    # float weights are quantized as gguf quantizes to Q8_0
    wf = torch.randn(48, 96)
    assert torch.equal(kernels.dequantize(kernels.pack_linear(wf, "q8_0")),
                       torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(wf.numpy(), T.Q8_0), T.Q8_0)))


def test_q8_0_file_runs_the_same_with_and_without_speculation(hf_dir, tmp_path):
    path = tmp_path / "q8.gguf"
    write_typed_gguf(hf_dir, path, T.Q8_0)
    assert _spec_check(path) > 0


def test_the_q8_0_converter_requantizes_matrices_and_keeps_the_rest(hf_dir, tmp_path):
    """specdecode.bench.gguf_q8_0: every matrix becomes gguf's Q8_0 quantization of gguf's decoding of it; vectors
    and metadata stay as they were, but for general.file_type, which says Q8_0."""
    from specdecode.bench.gguf_q8_0 import convert

    src, dst = tmp_path / "src.gguf", tmp_path / "q8.gguf"
    write_typed_gguf(hf_dir, src, [T.Q4_0, T.Q6_K, T.F16, T.Q8_0])
    assert convert(src, dst)["requantized"] > 0
    a, b = read_gguf(src), read_gguf(dst)
    assert b.metadata["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    assert {k: v for k, v in a.metadata.items() if k != "general.file_type"} == \
        {k: v for k, v in b.metadata.items() if k != "general.file_type"}
    assert a.tensor_names() == b.tensor_names()
    for name in a.tensor_names():
        t = a.load_tensor(name)
        if t.dim() == 2:
            assert b.tensor_type(name) == "Q8_0", name
            want = gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), T.Q8_0), T.Q8_0)
            assert torch.equal(b.load_tensor(name), torch.from_numpy(want)), name
        else:
            assert b.tensor_type(name) == a.tensor_type(name) and torch.equal(b.load_tensor(name), t), name
