"""Dense families beyond Llama's switches, against transformers: Mistral and Ministral with sliding windows,
Phi-3 / Phi-4, Granite 3 and OLMo 2.

Tiny random models saved by transformers (4 layers, hidden 64, vocab 512; a window of 8 so that every prompt runs
past it). Each must give transformers' logits (float32 KV cache) and greedy tokens: plain, under n-gram
speculation (k = 4) and batched with other prompts; the sliding-window ones the same output with prefix caching
and chunked prefill on and off. A GGUF written from the tiny model as llama.cpp's convert_hf_to_gguf.py writes it
(its architecture name, tensor names, Q/K permutation and metadata keys) reads back as that model.

The models: Mistral slides on every layer; Ministral interleaves sliding and full layers (``layer_types``);
Phi-3 has a window, LongRoPE (short factors: its pretraining length, 1024, is above every max_model_len used here)
with an attention factor, and rotates half of each head; "phi3_long" has a pretraining length of 32, so prompts of
40 tokens take the long factors in transformers and in ours; "phi4" has no window and no scaling (Phi-4: it runs
on the C++ layer stack); Granite has all four multipliers; OLMo 2 post-norms and whole-projection q/k norms.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers_families import LOGITS_TOL, N_GREEDY, add_gpt2_vocab, greedy_check, logits_check, ours, prefix_cache_check
from helpers_spec import llm_cache, one_thread  # noqa: F401  (fixtures)
from specdecode.engine.model_runner import ModelRunner
from specdecode.models.families import FAMILIES as REGISTRY
from specdecode.models.families import family_of
from specdecode.models.loader import load_model
from test_hf_parity import _hf_greedy, _hf_logits, _hf_model, _prompt
from tiny import VOCAB, build_tokenizer

FAMILIES = ("mistral", "ministral", "phi3", "granite", "olmo2")
SLIDING = ("mistral", "ministral", "phi3")
# those llama.cpp converts (Mistral and Ministral as llama, here with their windows in the metadata)
GGUF_FAMILIES = ("mistral", "ministral", "phi3", "granite", "olmo2")
WINDOW = 8
LAYERS = 4


def _longrope(original: int) -> dict:
    """LongRoPE parameters for head_dim 16 with half of it rotated: 4 factors per set."""
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
            "long_factor": [1.0, 2.5, 7.0, 19.0], "short_factor": [1.0, 1.25, 1.5, 2.0], "partial_rotary_factor": 0.5}


def build_dense(family: str, out: Path, seed: int = 0) -> Path:
    """A tiny model of one of this module's families (see the module docstring), saved by transformers with the
    tiny byte-level BPE tokenizer. Linear weights are sharpened (tiny.build_model does the same) and norm weights
    drawn around 1, so that a norm mapped to the wrong place changes the logits."""
    import transformers as T

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                  tie_word_embeddings=False)
    if family == "mistral":
        cfg = T.MistralConfig(sliding_window=WINDOW, max_position_embeddings=1024, **common)
    elif family == "ministral":
        cfg = T.MinistralConfig(sliding_window=WINDOW, max_position_embeddings=1024, head_dim=16, layer_types=[
            "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"], **common)
    elif family in ("phi3", "phi3_long"):
        original = 1024 if family == "phi3" else 32
        cfg = T.Phi3Config(sliding_window=WINDOW if family == "phi3" else None, max_position_embeddings=4096,
                           original_max_position_embeddings=original, partial_rotary_factor=0.5,
                           rope_parameters=_longrope(original), **common)
    elif family == "phi4":
        cfg = T.Phi3Config(sliding_window=None, max_position_embeddings=1024, **common)
    elif family == "granite":
        cfg = T.GraniteConfig(max_position_embeddings=1024, embedding_multiplier=6.0, residual_multiplier=0.5,
                              attention_multiplier=0.125, logits_scaling=0.75, **common)
    elif family == "olmo2":
        cfg = T.Olmo2Config(max_position_embeddings=1024, **common)
    else:
        raise ValueError(family)
    model = T.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0) if p.dim() == 2 else p.normal_(1.0, 0.3)
    model.save_pretrained(str(out))
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense")

    class Built(dict):  # each model built when a test first asks for it
        def __missing__(self, fam: str) -> Path:
            # Granite's seed-0 model does not fall into a loop within 32 tokens, so n-gram drafts never match
            self[fam] = build_dense(fam, root / fam, seed=1 if fam == "granite" else 0)
            return self[fam]
    return Built()


@pytest.fixture(scope="module")
def hf(models, one_thread):
    memo = {}

    def get(fam):
        if fam not in memo:
            memo[fam] = _hf_model(models[fam])
        return memo[fam]
    return get


def _args(path: Path):
    config = json.loads((path / "config.json").read_text())
    fam = family_of(config)
    return fam, REGISTRY[fam].make_args(config, fam)


@pytest.mark.parametrize("fam", FAMILIES + ("phi3_long", "phi4"))
def test_config_maps_onto_the_decoder(fam, models):
    our_fam, a = _args(models[fam])
    assert our_fam == {"phi3_long": "phi3", "phi4": "phi3"}.get(fam, fam)
    slides = {"mistral": (True,) * 4, "ministral": (True, False, True, True), "phi3": (True,) * 4}.get(fam, ())
    assert a.sliding_layers == slides and a.sliding_window == (WINDOW if slides else None)
    if fam.startswith("phi3"):
        assert a.rotary_dim == 8 and a.rope_scaling["rope_type"] == "longrope"
        assert a.rope_scaling["factor"] == 4096 / a.rope_scaling["original_max_position_embeddings"]
    if fam == "granite":
        assert (a.embed_scale, a.residual_scale, a.attn_scale, a.logit_divisor) == (6.0, 0.5, 0.125, 0.75)
    if fam == "olmo2":
        assert (a.pre_norms, a.sandwich_norms, a.qk_norm, a.qk_norm_whole) == (False, True, True, True)
    model = load_model(models[fam], "float32", "cpu", 64, None).model
    # Phi-4 (no window, every dim rotated) is Llama to the C++ layer stack; the others run the Python layers.
    assert model.stack_family() == (fam == "phi4")


def test_phi3_configs_as_transformers_4_saved_them():
    """Phi-3-mini-128k / Phi-4-mini style config.json (transformers 4): ``rope_scaling`` of type su or longrope,
    the pretraining length, theta and partial_rotary_factor at the top level; no attention factor (HF's default)."""
    import math

    c = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "rope_theta": 10000.0,
         "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
         "sliding_window": 262144, "rope_scaling": {"type": "su", "long_factor": [2.0] * 6, "short_factor": [1.0] * 6}}
    a = REGISTRY["phi3"].make_args(c, "phi3")
    assert a.rotary_dim == 12 and a.sliding_layers == (True, True) and a.rope_theta == 10000.0
    s = a.rope_scaling
    assert (s["rope_type"], s["original_max_position_embeddings"], s["factor"]) == ("longrope", 4096, 32.0)
    from specdecode.layers.rotary import Rotary

    short, long = Rotary(12, 64, 1e4, s), Rotary(12, 8192, 1e4, s)
    attn = math.sqrt(1 + math.log(32) / math.log(4096))
    assert torch.allclose(short.cos[0], torch.full((12,), attn)) and torch.equal(long.cos[0], short.cos[0])
    assert not torch.allclose(short.cos[5], long.cos[5])  # the long factors past 4096 positions of context
    with pytest.raises(ValueError, match="head_dim"):
        REGISTRY["phi3"].make_args({**c, "head_dim": 8}, "phi3")


def test_a_window_as_long_as_the_context_is_full_attention(models, hf):
    """Mistral whose window covers max_model_len (Mistral 7B v0.1: 4096 of 4096) runs with full attention, on the
    C++ layer stack, and still gives transformers' logits."""
    assert not load_model(models["mistral"], "float32", "cpu", WINDOW + 1, None).model.stack_family()
    loaded = load_model(models["mistral"], "float32", "cpu", WINDOW, None)
    assert loaded.model.stack_family()
    ids = _prompt(VOCAB, n=WINDOW)
    runner = ModelRunner(loaded, 1, WINDOW, "cpu", kv_cache_dtype="float32")
    want = _hf_logits(hf("mistral"), ids)
    assert (runner.forward_rows([(0, 0, ids)], all_logits=True)[0] - want).abs().max().item() < LOGITS_TOL


@pytest.mark.parametrize("fam", FAMILIES + ("phi3_long", "phi4"))
def test_logits_match_transformers(fam, models, hf):
    # 40 tokens: past the window, over two block boundaries, and past phi3_long's pretraining length of 32
    logits_check(models[fam], hf(fam), _prompt(VOCAB, n=40), fam)


@pytest.mark.parametrize("fam", ("phi3", "olmo2"))
def test_compiled_rows_stay_invariant(fam, models, one_thread):
    """--compile: the Python layers compiled with the new switches (partial rotary; post-norms only and
    whole-projection q/k norms) still give a row the same logits decoded alone or verified with others,
    close to eager."""
    from test_compile import eager_and_compiled_rows

    out = eager_and_compiled_rows(models[fam], None, _prompt(VOCAB, n=30))
    assert (out["eager"] - out["compiled"]).abs().max().item() < 1e-3


@pytest.mark.parametrize("fam", FAMILIES)
def test_greedy_matches_transformers_plain_speculative_and_batched(fam, models, hf, llm_cache):
    greedy_check(models[fam], hf(fam), _prompt(VOCAB, n=24, seed=0), llm_cache)


def test_phi3_long_factors_greedy(models, hf, llm_cache):
    """A prompt past the pretraining length: transformers takes the long factors from the first step, as ours
    does for any max_model_len beyond that length."""
    model = hf("phi3_long")
    ids = _prompt(VOCAB, n=40, seed=3)
    plain = llm_cache.get(models["phi3_long"], max_model_len=128)
    assert ours(plain, [ids]) == [_hf_greedy(model, ids, N_GREEDY)]


@pytest.mark.parametrize("fam", SLIDING)
def test_prefix_caching_and_chunked_prefill_give_bitwise_the_same_output(fam, models, one_thread):
    """Prompts sharing a 70-token head (4 whole blocks, far past the window): prefilled whole without the cache,
    or in chunks of 32 with the head's blocks from the cache, the token ids and logprobs are bitwise the same,
    also when they arrive together or run under n-gram speculation."""
    prefix_cache_check(models[fam])


def test_unsupported_architecture_lists_the_new_families():
    with pytest.raises(ValueError) as e:
        family_of({"architectures": ["NoSuchForCausalLM"]})
    for arch in ("MistralForCausalLM", "MinistralForCausalLM", "Phi3ForCausalLM", "GraniteForCausalLM",
                 "Olmo2ForCausalLM"):
        assert arch in str(e.value)
    from specdecode.models.gguf_loader import SUPPORTED_ARCHITECTURES

    assert {"phi3", "granite", "olmo2"} <= set(SUPPORTED_ARCHITECTURES)


# ---------------------------------------------------------------------------------------------------- GGUF
_GGUF_ARCH = {"mistral": "llama", "ministral": "llama", "phi3": "phi3", "granite": "granite", "olmo2": "olmo2"}


def _permute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order for its "normal" rope (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def write_gguf(hf_dir: Path, path: Path, fam: str, window_key: bool = True) -> Path:
    """A GGUF file of a tiny HF model as llama.cpp's converter writes it: the architecture name it uses, the
    tensor names of gguf's own TensorNameMap, Q/K rows permuted where the architecture is Llama's (llama,
    granite), the metadata keys its converter sets (Phi-3: rotated dims, pretraining length, window, LongRoPE
    factors as tensors and the attention factor; Granite: the four scales, no head_dim), and the tiny tokenizer
    as a ``gpt2`` vocabulary. ``window_key``: llama.cpp writes Mistral without its sliding window; with it the
    file says what the model does."""
    import gguf
    from safetensors.torch import load_file

    c = json.loads((hf_dir / "config.json").read_text())
    arch = _GGUF_ARCH[fam]
    heads, kv_heads, hidden = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
    head_dim = c.get("head_dim") or hidden // heads
    rp = c.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", c["max_position_embeddings"]), ("embedding_length", hidden),
                       ("block_count", c["num_hidden_layers"]), ("feed_forward_length", c["intermediate_size"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("vocab_size", c["vocab_size"])):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", rp.get("rope_theta", c.get("rope_theta", 10000.0)))
    rope_dims = int(rp.get("partial_rotary_factor", 1.0) * hidden) // heads
    w.add_uint32(f"{arch}.rope.dimension_count", rope_dims)
    extra: dict[str, np.ndarray] = {}
    if fam in ("mistral", "ministral") and window_key:
        w.add_uint32(f"{arch}.attention.sliding_window", c["sliding_window"])
        if fam == "ministral":
            w.add_array(f"{arch}.attention.sliding_window_pattern", [t == "sliding_attention" for t in c["layer_types"]])
    if fam == "phi3":
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", rp["original_max_position_embeddings"])
        w.add_uint32(f"{arch}.attention.sliding_window", c.get("sliding_window") or 0)
        scale = c["max_position_embeddings"] / rp["original_max_position_embeddings"]
        w.add_float32(f"{arch}.rope.scaling.attn_factor",
                      float(np.sqrt(1 + np.log(scale) / np.log(rp["original_max_position_embeddings"]))))
        extra = {"rope_factors_long.weight": np.array(rp["long_factor"], dtype=np.float32),
                 "rope_factors_short.weight": np.array(rp["short_factor"], dtype=np.float32)}
    if fam == "granite":
        for key, hf_key in (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                            ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
            w.add_float32(f"{arch}.{key}", c[hf_key])
    add_gpt2_vocab(w, hf_dir)
    names = gguf.TensorNameMap(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), c["num_hidden_layers"])
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        base, kind = name.rsplit(".", 1)
        gname = names.get_name(base)
        assert gname is not None, name
        if arch in ("llama", "granite") and base.endswith(("q_proj", "k_proj")):
            t = _permute(t, heads if base.endswith("q_proj") else kv_heads)
        w.add_tensor(f"{gname}.{kind}", t.float().numpy())
    for name, t in extra.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_models(models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dense_gguf")
    return {fam: write_gguf(models[fam], root / f"{fam}.gguf", fam) for fam in GGUF_FAMILIES}


_ARG_FIELDS = ("sliding_window", "sliding_layers", "attn_scale", "rope_theta", "rotary_dim", "qk_norm",
               "qk_norm_whole", "pre_norms", "sandwich_norms", "embed_scale", "residual_scale", "logit_divisor",
               "activation", "tie_embeddings", "num_kv_heads", "head_dim")


@pytest.mark.parametrize("fam", GGUF_FAMILIES)
def test_gguf_gives_transformers_logits_and_greedy_tokens(fam, models, gguf_models, hf, llm_cache):
    """The GGUF written from a tiny HF model reads back as that model (config and parameters), gives transformers'
    logits on the HF model, and its greedy tokens plain, under n-gram speculation and batched."""
    from specdecode.models.gguf_loader import read_gguf

    path, hf_dir = gguf_models[fam], models[fam]
    config = read_gguf(path).config
    want_fam, want_args = _args(hf_dir)
    got_fam = family_of(config)
    got_args = REGISTRY[got_fam].make_args(config, got_fam)
    assert got_fam == want_fam
    for field in _ARG_FIELDS:
        assert getattr(got_args, field) == pytest.approx(getattr(want_args, field)), field
    if fam == "phi3":
        for key in ("long_factor", "short_factor", "original_max_position_embeddings", "factor"):
            assert got_args.rope_scaling[key] == want_args.rope_scaling[key], key
    ours = dict(load_model(path, "float32", "cpu", 64, None).model.state_dict())
    ref = dict(load_model(hf_dir, "float32", "cpu", 64, None).model.state_dict())
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    logits_check(path, hf(fam), _prompt(VOCAB, n=40), f"{fam} gguf")
    greedy_check(path, hf(fam), _prompt(VOCAB, n=24, seed=0), llm_cache)


def test_llama_gguf_without_a_window_is_plain_llama(models, tmp_path):
    """llama.cpp's converter writes Mistral without its window: such a file runs as Llama with full attention
    (as llama.cpp runs it); a per-layer pattern beside the window makes it Ministral."""
    from specdecode.models.gguf_loader import read_gguf

    plain = read_gguf(write_gguf(models["mistral"], tmp_path / "plain.gguf", "mistral", window_key=False)).config
    assert family_of(plain) == "llama" and REGISTRY["llama"].make_args(plain, "llama").sliding_window is None
