"""Mixtures of experts against transformers: Mixtral, Qwen2-MoE (shared expert behind a sigmoid gate) and
Qwen3-MoE (q/k norms, renormalized top-k).

Tiny random models saved by transformers (3 layers, hidden 64, 4 experts of which 2 run per token; the Qwen models
keep a dense MLP in one layer through mlp_only_layers). Each must give transformers' logits and greedy tokens:
plain, under n-gram speculation (k = 4), batched with other prompts, with prefix caching and chunked prefill on
or off, and from a GGUF written in llama.cpp's layout. The MoE layer itself gives a token bitwise the same output
alone or among other tokens, in float32 and in the quantized formats.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers_spec import GREEDY, PROMPTS, llm_cache, one_thread  # noqa: F401  (fixtures)
from specdecode import LLM, SamplingParams
from specdecode.engine.model_runner import ModelRunner
from specdecode.layers.moe import MoEArgs, SparseMoE
from specdecode.models.families import FAMILIES as REGISTRY
from specdecode.models.families import family_of
from specdecode.models.loader import load_model
from helpers_families import logits_check, ours, prefix_cache_check
from test_families import hf  # noqa: F401  (hf: a fixture, over this module's models)
from test_gguf_loader import _llamacpp_permute
from test_hf_parity import _hf_greedy, _hf_logits, _hf_model, _prompt
from tiny import VOCAB, build_tokenizer

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
LOGITS_TOL = 1e-4  # float32 KV cache: transformers' logits up to float32 rounding
N_GREEDY = 32
LAYERS = 3
# Against transformers, keys and values are cached in float32 as it caches them: the default 16-bit cache rounds
# them, and Mixtral's tiny model has a greedy step whose top two logits are 1.6e-3 apart.
HF_KV = "float32"


def build_moe(family: str, out: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random MoE saved by transformers, its weights sharpened (as tiny.build_model does) so that greedy
    tokens and the routing are far from ties."""
    import transformers as T

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0, hidden_size=64,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=False, num_experts_per_tok=2, **overrides)
    if family == "mixtral":
        cfg = T.MixtralConfig(intermediate_size=96, num_local_experts=4, **common)
    elif family == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=64, num_experts=4, head_dim=16,
                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], **common)
    else:
        cfg = T.Qwen2MoeConfig(intermediate_size=128, moe_intermediate_size=48, shared_expert_intermediate_size=80,
                               num_experts=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0],
                               **common)
    model = T.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    model.save_pretrained(str(out))
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {f: build_moe(f, root / f) for f in FAMILIES}


@pytest.mark.parametrize("fam", FAMILIES)
def test_config_maps_onto_the_decoder(fam, models):
    config = json.loads((models[fam] / "config.json").read_text())
    assert family_of(config) == fam
    a = REGISTRY[fam].make_args(config, fam)
    m = a.moe
    assert (m.num_experts, m.top_k) == (4, 2)
    assert m.norm_topk_prob is (fam != "qwen2_moe")
    assert m.shared_intermediate_size == (80 if fam == "qwen2_moe" else 0)
    assert [m.is_sparse(i) for i in range(LAYERS)] == {"mixtral": [True] * 3, "qwen3_moe": [True, False, True],
                                                       "qwen2_moe": [False, True, True]}[fam]
    assert (a.qkv_bias, a.qk_norm) == (fam == "qwen2_moe", fam == "qwen3_moe")
    model = load_model(models[fam], "float32", "cpu", 64, None).model
    assert not model.stack_family()  # the experts run in the Python layers
    assert sum(L.moe is not None for L in model.layers) == sum(m.is_sparse(i) for i in range(LAYERS))


@pytest.mark.parametrize("fam", FAMILIES)
def test_logits_match_transformers(fam, models, hf):
    """Prefill's last row, every row through the verification path, and a prefill of the first half followed by
    the rest as one multi-token decode over the cached half: all transformers' logits (test_families' check)."""
    logits_check(models[fam], hf(fam), _prompt(VOCAB, n=40), fam)


REPEAT = [17, 42, 99, 5, 300, 7] * 4  # n-gram drafts find matches in the prompt and in the looping output


def _check_greedy(path, want: list[list[int]], prompts: list[list[int]], llm_cache, **kw) -> None:
    """Plain (each prompt alone and all batched) and n-gram speculation (k = 4; a repetitive prompt alone and
    all batched) give ``want``, and speculation accepted drafts."""
    plain = llm_cache.get(path, max_model_len=128, **kw)
    assert [ours(plain, [p])[0] for p in prompts] == want
    assert ours(plain, prompts) == want  # batched with each other
    ngram = llm_cache.get(path, max_model_len=128, speculative_model="[ngram]", num_speculative_tokens=4, **kw)
    for batch in ([prompts[1]], prompts):
        outs = ngram.generate(prompt_token_ids=batch, use_tqdm=False,
                              sampling_params=SamplingParams(max_tokens=N_GREEDY, **GREEDY))
        assert [list(o.outputs[0].token_ids) for o in outs] == [want[prompts.index(p)] for p in batch]
        assert sum(o.metrics.spec_decode.num_accepted_tokens for o in outs) > 0


def _matches_transformers(path, model, llm_cache) -> None:
    """The model at ``path`` (HF or GGUF) gives transformers' ``model``'s logits for a 40-token prompt and its
    greedy tokens for that prompt's head and the usual prompts, plain, speculative and batched."""
    ids = _prompt(VOCAB, n=40)
    runner = ModelRunner(load_model(path, "float32", "cpu", 256, None), 1, 256, "cpu", kv_cache_dtype="float32")
    diff = (runner.forward_rows([(0, 0, ids)], all_logits=True)[0] - _hf_logits(model, ids)).abs().max().item()
    assert diff < LOGITS_TOL
    prompts = [ids[:24], REPEAT] + PROMPTS
    _check_greedy(path, [_hf_greedy(model, p, N_GREEDY) for p in prompts], prompts, llm_cache, kv_cache_dtype=HF_KV)


@pytest.mark.parametrize("fam", FAMILIES)
def test_greedy_matches_transformers_plain_speculative_and_batched(fam, models, hf, llm_cache):
    model = hf(fam)
    prompts = [_prompt(VOCAB, n=24, seed=0), REPEAT] + PROMPTS
    want = [_hf_greedy(model, p, N_GREEDY) for p in prompts]
    assert len({tuple(w) for w in want}) == len(want)
    _check_greedy(models[fam], want, prompts, llm_cache, kv_cache_dtype=HF_KV)


def test_mixtral_with_a_sliding_window(tmp_path, llm_cache, one_thread):
    """Mixtral's config may set a sliding window (Mistral's): every layer then attends within it, as in
    transformers, prompts and outputs running far past it."""
    path = build_moe("mixtral", tmp_path / "swa", seed=1, sliding_window=8)
    args = REGISTRY["mixtral"].make_args(json.loads((path / "config.json").read_text()), "mixtral")
    assert args.sliding_window == 8 and args.sliding_layers == (True,) * LAYERS
    _matches_transformers(path, _hf_model(path), llm_cache)


@pytest.mark.parametrize("fam", FAMILIES)
def test_quantized_experts_stay_exact_under_speculation(fam, models, llm_cache, one_thread):
    """w8a8 experts (the format "auto" picks for a large float checkpoint; the router stays float32): n-gram
    speculation and batching give the plain run's greedy tokens."""
    model = load_model(models[fam], "float32", "cpu", 64, "w8a8").model
    layer = next(L for L in model.layers if L.moe is not None)
    assert layer.moe.experts[0].gate_up_proj.packed.fmt == "w8a8" and layer.moe.router.packed.fmt == "fp32"
    prompts = [_prompt(VOCAB, n=24, seed=0), REPEAT] + PROMPTS
    plain = llm_cache.get(models[fam], max_model_len=128, quantization="w8a8")
    want = [ours(plain, [p])[0] for p in prompts]
    _check_greedy(models[fam], want, prompts, llm_cache, quantization="w8a8")


def test_compiled_rows_stay_invariant(models, one_thread):
    """--compile: the layers compiled around the (eager) experts still give a row the same logits decoded alone
    or verified with others, close to eager."""
    from test_compile import eager_and_compiled_rows

    out = eager_and_compiled_rows(models["qwen2_moe"], None, _prompt(VOCAB, n=30))
    assert (out["eager"] - out["compiled"]).abs().max().item() < 1e-3


def test_packed_cache_entry_holds_the_experts(models, tmp_path, monkeypatch, one_thread):
    """A w8a8 Qwen2-MoE converted once and mapped back from the packed-weight cache: every expert, router and
    shared-expert linear comes back in its format with the same bytes, and the logits are bitwise the same."""
    from specdecode.layers.linear import Linear

    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    first = load_model(models["qwen2_moe"], "float32", "cpu", 64, "w8a8", packed_cache=False)
    load_model(models["qwen2_moe"], "float32", "cpu", 64, "w8a8", packed_cache=True)  # converts, writes the entry
    assert list((tmp_path / "cache").rglob("*"))
    again = load_model(models["qwen2_moe"], "float32", "cpu", 64, "w8a8", packed_cache=True)  # maps it
    lins = [{n: m for n, m in x.model.named_modules() if isinstance(m, Linear)} for x in (first, again)]
    assert lins[0].keys() == lins[1].keys() and "layers.1.moe.shared_gate" in lins[0]
    for n, m in lins[0].items():
        other = lins[1][n].packed
        assert (m.packed.fmt, m.packed.weight.dtype) == (other.fmt, other.weight.dtype), n
        assert torch.equal(m.packed.weight, other.weight), n
    ids = _prompt(VOCAB, n=20)
    logits = [ModelRunner(x, 1, 64, "cpu").forward_rows([(0, 0, ids)], all_logits=True)[0] for x in (first, again)]
    assert torch.equal(*logits)


@pytest.mark.parametrize("fam", FAMILIES)
def test_prefix_caching_and_chunked_prefill_give_bitwise_the_same_output(fam, models, one_thread):
    """Prompts sharing a 70-token head (4 whole blocks): prefilled whole without the cache, or in chunks of 32
    with the head's blocks from the cache, the token ids and logprobs are bitwise the same, also when they
    arrive together or run under n-gram speculation (test_families' check)."""
    prefix_cache_check(models[fam])


# ------------------------------------------------------------------------------------------- row invariance
@pytest.mark.parametrize("fmt", [None, "w8a8", "w4a8"])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_layer_rows_are_bitwise_the_same_alone_and_in_a_batch(fmt, shared, one_thread):
    """One token through the MoE layer alone, then among 1..12 other tokens (routed to other experts and to the
    same ones), at every position of the batch: bitwise the same output."""
    from specdecode.layers.linear import row_invariant

    torch.manual_seed(0)
    m = MoEArgs(num_experts=8, top_k=2, intermediate_size=64, norm_topk_prob=not shared,
                shared_intermediate_size=48 if shared else 0)
    moe = SparseMoE(64, m, "silu")
    for p in moe.parameters():
        p.data.normal_(0.0, 0.5)
    moe.fuse_projections()
    for lin in [mod for mod in moe.modules() if hasattr(mod, "prepare")]:
        lin.prepare(fmt)
    x = torch.randn(40, 64)
    with row_invariant(True), torch.inference_mode():
        alone = torch.stack([moe(x[i:i + 1])[0] for i in range(len(x))])
        ids, _ = moe.route(x)
        assert len(torch.unique(ids)) == 8  # the batch spreads over every expert
        for n in (2, 5, 13, 40):
            for start in range(0, len(x) - n + 1, max(1, n // 2)):
                got = moe(x[start:start + n])
                assert torch.equal(got, alone[start:start + n]), (n, start)
        # the same token beside copies of itself and beside others, at each position
        batch = torch.cat([x[3:4], x[10:15], x[3:4], x[3:4]])
        got = moe(batch)
        for row in (0, 6, 7):
            assert torch.equal(got[row], alone[3])
    assert alone.abs().max().item() > 0


# ---------------------------------------------------------------------------------------------------- GGUF
_ATTENTION = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",
              "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
              "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}
# expert projection -> llama.cpp's stacked tensor (Mixtral's w1 / w3 / w2 are gate / up / down)
_EXPERTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def write_moe_gguf(hf_dir: Path, path: Path, stacked: bool = True, expert_type: str = "F32") -> Path:
    """A GGUF of a tiny HF MoE as llama.cpp's convert_hf_to_gguf.py writes it: Mixtral as ``llama`` (q/k rows
    permuted), its experts stacked into one 3-D tensor per projection (``stacked``; per-expert tensors
    blk.N.ffn_gate.E.weight as older Mixtral files have them otherwise), in ``expert_type`` (F32 or Q8_0), the
    expert metadata, and the tiny byte-level BPE tokenizer."""
    import gguf
    from safetensors.torch import load_file

    c = json.loads((hf_dir / "config.json").read_text())
    arch = _ARCH[c["model_type"]]
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    for key, value in (("context_length", c["max_position_embeddings"]), ("embedding_length", c["hidden_size"]),
                       ("block_count", c["num_hidden_layers"]), ("feed_forward_length", c["intermediate_size"]),
                       ("attention.head_count", c["num_attention_heads"]), ("vocab_size", c["vocab_size"]),
                       ("attention.head_count_kv", c["num_key_value_heads"]), ("attention.key_length", head_dim),
                       ("attention.value_length", head_dim), ("rope.dimension_count", head_dim),
                       ("expert_count", c.get("num_local_experts") or c["num_experts"]),
                       ("expert_used_count", c["num_experts_per_tok"])):
        w.add_uint32(f"{arch}.{key}", value)
    if arch != "llama":
        w.add_uint32(f"{arch}.expert_feed_forward_length", c["moe_intermediate_size"])
    if c.get("shared_expert_intermediate_size"):
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", c["shared_expert_intermediate_size"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", c["rope_parameters"]["rope_theta"])
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = {i: t for t, i in tok["model"]["vocab"].items()}
    vocab.update({a["id"]: a["content"] for a in tok["added_tokens"]})
    specials = {a["id"] for a in tok["added_tokens"]}
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [vocab.get(i, f"<unused{i}>") for i in range(c["vocab_size"])])
    w.add_array("tokenizer.ggml.token_type", [3 if i in specials or i not in vocab else 1
                                              for i in range(c["vocab_size"])])
    w.add_array("tokenizer.ggml.merges", [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_uint32("tokenizer.ggml.bos_token_id", c["bos_token_id"])
    w.add_uint32("tokenizer.ggml.eos_token_id", c["eos_token_id"])

    def add(name: str, t: np.ndarray, quantize: bool = False) -> None:
        if quantize and expert_type == "Q8_0":
            w.add_tensor(name, gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))

    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        t = t.float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            add({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name], t)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        module, kind = rest.rsplit(".", 1)
        if ".experts." in module:
            _, e, proj = module.rsplit(".", 2)
            experts.setdefault((layer, _EXPERTS[proj]), {})[int(e)] = t
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            t = _llamacpp_permute(t, c["num_attention_heads"] if "q_proj" in module else c["num_key_value_heads"])
        add(f"blk.{layer}.{_ATTENTION[module]}.{kind}", t)
    for (layer, proj), per_expert in experts.items():
        if stacked:
            add(f"blk.{layer}.ffn_{proj}_exps.weight", np.stack([per_expert[e] for e in sorted(per_expert)]), True)
        else:
            for e, t in sorted(per_expert.items()):
                add(f"blk.{layer}.ffn_{proj}.{e}.weight", t, True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_files(models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_gguf")
    return {f: write_moe_gguf(models[f], root / f"{f}.gguf") for f in FAMILIES}


@pytest.mark.parametrize("fam", FAMILIES)
def test_gguf_gives_transformers_greedy_tokens(fam, models, gguf_files, hf, llm_cache):
    """The GGUF written from the tiny HF model reads back as that model (config and parameters) and gives
    transformers' logits and greedy tokens: plain, under n-gram speculation and batched."""
    from specdecode.models.gguf_loader import read_gguf

    path = gguf_files[fam]
    config = read_gguf(path).config
    assert family_of(config) == fam
    hf_config = json.loads((models[fam] / "config.json").read_text())
    got, want = (REGISTRY[fam].make_args(c, fam) for c in (config, hf_config))
    assert got.norm_eps == pytest.approx(want.norm_eps)  # a float32 in the file
    assert replace(got, norm_eps=want.norm_eps) == want
    got = dict(load_model(path, "float32", "cpu", 64, None).model.state_dict())
    ref = dict(load_model(models[fam], "float32", "cpu", 64, None).model.state_dict())
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)

    _matches_transformers(path, hf(fam), llm_cache)


def test_gguf_expert_layouts_and_quantized_experts(models, tmp_path, one_thread):
    """Older Mixtral files with one tensor per expert read as the stacked ones do; Q8_0 experts split from their
    3-D stack are exactly the gguf package's dequantization of each expert's slice, and under
    quantization="mixed" (Q8_0 blocks kept as stored, the q8_0 format) run exactly under speculation."""
    import gguf

    from specdecode.models.gguf_loader import read_gguf

    stacked = read_gguf(write_moe_gguf(models["mixtral"], tmp_path / "stacked.gguf"))
    old = read_gguf(write_moe_gguf(models["mixtral"], tmp_path / "old.gguf", stacked=False))
    assert sorted(old.tensor_names()) == sorted(stacked.tensor_names())
    assert "model.layers.2.block_sparse_moe.experts.3.w2.weight" in old.tensor_names()
    for name in old.tensor_names():
        assert torch.equal(old.load_tensor(name), stacked.load_tensor(name)), name

    path = write_moe_gguf(models["qwen3_moe"], tmp_path / "q8.gguf", expert_type="Q8_0")
    g = read_gguf(path)
    reader = gguf.GGUFReader(str(path))
    whole = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    for layer, e, proj in ((0, 0, "gate"), (0, 3, "down"), (2, 2, "up")):
        name = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
        assert g.tensor_type(name) == "Q8_0"
        assert torch.equal(g.load_tensor(name), torch.from_numpy(np.ascontiguousarray(
            whole[f"blk.{layer}.ffn_{proj}_exps.weight"][e])))
    g.close()
    model = load_model(path, "float32", "cpu", 64, "mixed").model
    assert model.layers[0].moe.experts[1].gate_up_proj.packed.fmt == "q8_0"
    prompts = [REPEAT] + PROMPTS
    plain = LLM(str(path), max_model_len=128, quantization="mixed", speculative_config={"method": "none"})
    want = ours(plain, prompts)
    spec = LLM(str(path), max_model_len=128, quantization="mixed", speculative_model="[ngram]",
               num_speculative_tokens=4)
    assert [ours(spec, [p])[0] for p in prompts] == want and ours(spec, prompts) == want
