"""Gemma 2 and Gemma 3 (text).

What sets them apart from Llama (transformers' modeling_gemma2.py / modeling_gemma3.py):
- sliding-window layers interleaved with global ones (``layer_types``);
- RMSNorm scaling by (1 + w): folded into the weight once at load, the same float32 values HF computes per call;
- norms after attention and after the MLP as well as before them (``sandwich_norms``);
- embeddings times sqrt(hidden), queries scaled by query_pre_attn_scalar ** -0.5, GELU-tanh;
- tanh soft-capping of attention scores and of the final logits (Gemma 2; optional in Gemma 3);
- Gemma 3: q/k norms, and its own RoPE base for the sliding layers (rope_local_base_freq).

Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration: the 4B and larger) load as their text model:
its config is their ``text_config``, its tensors those under ``language_model``; the vision tower is left out.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import torch

from specdecode.models.families.base import Family, GGUFArch, rename, rope_params
from specdecode.models.families.llama import ATTENTION_MLP_RENAMES
from specdecode.models.model import ModelArgs

_GEMMA_RENAMES = ATTENTION_MLP_RENAMES + [
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.post_attn_norm."),
    (r"^model\.layers\.(\d+)\.pre_feedforward_layernorm\.", r"layers.\1.mlp_norm."),
    (r"^model\.layers\.(\d+)\.post_feedforward_layernorm\.", r"layers.\1.post_mlp_norm."),
]


def _sliding_layers(c: dict, family: str) -> tuple[bool, ...]:
    """Which layers attend within the window: ``layer_types`` where the config has it, else the family's
    default pattern (Gemma 2 alternates starting with a sliding layer; Gemma 3 has five sliding per global)."""
    n = c["num_hidden_layers"]
    types = c.get("layer_types")
    if types:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"Unsupported layer types {sorted(unknown)} in this {family} config.")
        return tuple(t == "sliding_attention" for t in types)
    every = 2 if family == "gemma2" else int(c.get("sliding_window_pattern", 6))
    return tuple(bool((i + 1) % every) for i in range(n))


def _gemma3_rope(c: dict) -> tuple[float, dict | None, float]:
    """(global theta, global scaling, local theta): transformers 5 keeps one rope_parameters per layer type;
    older configs have rope_theta, rope_scaling and rope_local_base_freq."""
    rp = c.get("rope_parameters") or {}
    full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling on Gemma 3's sliding layers ({local['rope_type']!r}) is not supported.")
    theta = float(full.get("rope_theta") or c.get("rope_theta") or 1_000_000.0)
    scaling = c.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    return theta, scaling, float(local.get("rope_theta") or c.get("rope_local_base_freq") or 10_000.0)


def gemma_args(c: dict, family: str) -> ModelArgs:
    if "text_config" in c:  # a multimodal checkpoint: its language model
        c = {**c["text_config"], "architectures": c.get("architectures")}
    if c.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with bidirectional attention (an embedding model) is not a causal LM.")
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    if family == "gemma3":
        theta, scaling, local_theta = _gemma3_rope(c)
    else:
        (theta, scaling), local_theta = rope_params(c), None
    sliding = _sliding_layers(c, family)
    window = c.get("sliding_window") if any(sliding) else None
    return ModelArgs(
        family=family, vocab_size=c["vocab_size"], hidden_size=hidden, num_layers=c["num_hidden_layers"],
        num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or hidden // heads, intermediate_size=c["intermediate_size"],
        max_position_embeddings=c.get("max_position_embeddings", 8192), norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=scaling,
        activation=c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh",
        qkv_bias=bool(c.get("attention_bias", False)), out_bias=bool(c.get("attention_bias", False)),
        qk_norm=family == "gemma3", tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        bos_token_id=c.get("bos_token_id"), eos_token_id=c.get("eos_token_id"),
        sliding_window=int(window) if window else None, sliding_layers=sliding if window else (),
        local_rope_theta=local_theta if window else None,
        attn_scale=float(c.get("query_pre_attn_scalar") or c.get("head_dim") or hidden // heads) ** -0.5,
        attn_softcap=c.get("attn_logit_softcapping"), final_softcap=c.get("final_logit_softcapping"),
        embed_scale=hidden ** 0.5, sandwich_norms=True)


# The language model's tensors in a multimodal checkpoint, as saved by transformers 4 and 5.
_LANGUAGE_MODEL = re.compile(r"^(language_model\.model\.|model\.language_model\.|language_model\.(?=lm_head\.))")


def map_gemma(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    name = _LANGUAGE_MODEL.sub(lambda m: "" if m.group(0) == "language_model." else "model.", name)
    new = rename(_GEMMA_RENAMES, name)
    if new is None:
        return []
    if new.endswith("norm.weight"):
        t = t.float() + 1.0  # Gemma's RMSNorm multiplies by (1 + w), computed in float32
    return [(new, t)]


GEMMA = Family(gemma_args, map_gemma)


# ---- GGUF, as llama.cpp's convert_hf_to_gguf.py writes Gemma (the names it shares with Llama map as Llama's)
_GGUF_RENAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}


def _gguf_transform(hf_name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    # llama.cpp stores the norms as 1 + w; back to HF's w (as transformers' GGUF loader does), so that
    # map_gemma's 1 + w gives transformers' values bitwise
    return (lambda t: t - 1) if hf_name.endswith("norm.weight") else None


def _gguf_config(get: Callable[..., Any], c: dict) -> dict:
    """The Gemma keys of an HF config from llama.cpp's metadata and defaults (llama.cpp's llama-model.cpp):
    it stores no query_pre_attn_scalar (queries are scaled by head_dim ** -0.5, by (hidden / heads) ** -0.5 in
    the 27B models), nor the layer pattern (every other layer slides in Gemma 2, five of six in Gemma 3), nor
    Gemma 3's local RoPE base (10000)."""
    gemma2 = c["model_type"] == "gemma2"
    layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    big = layers == (46 if gemma2 else 62)
    pattern = get("attention.sliding_window_pattern", 2 if gemma2 else 6)
    sliding = ([bool(x) for x in pattern] if isinstance(pattern, list)
               else [bool((i + 1) % int(pattern)) for i in range(layers)])
    out = {**c, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": get("attention.sliding_window"),
           "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
           "query_pre_attn_scalar": hidden // heads if big else c["head_dim"],
           "final_logit_softcapping": get("final_logit_softcapping", 30.0 if gemma2 else None),
           "attn_logit_softcapping": get("attn_logit_softcapping", 50.0 if gemma2 else None)}
    if not gemma2:
        out["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10_000.0))
    return out


# Gemma's turn format, as in the chat template of Google's Gemma 2 and 3 tokenizers (a system message opens the
# first user turn; the assistant is "model"), for GGUF files converted without it (the Gemma 3 270M package).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- set text = m['content'] if m['content'] is string else m['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n'"
    " + (prefix if loop.first else '') + (text | trim) + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")

GGUF_ARCHS = {arch: GGUFArch(cls, _GGUF_RENAMES, _gguf_transform, _gguf_config, CHAT_TEMPLATE)
              for arch, cls in (("gemma2", "Gemma2ForCausalLM"), ("gemma3", "Gemma3ForCausalLM"))}
