"""Llama and the families that differ from it only in switches: Mistral, Qwen2 (q/k/v biases), Qwen3 (q/k norm)."""
from __future__ import annotations

from specdecode.models.families.base import Family, map_simple, rope_params
from specdecode.models.model import ModelArgs


def llama_args(c: dict, family: str) -> ModelArgs:
    heads = c["num_attention_heads"]
    theta, scaling = rope_params(c)
    return ModelArgs(
        family=family, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        intermediate_size=c["intermediate_size"],
        max_position_embeddings=c.get("max_position_embeddings", 4096),
        norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        activation=c.get("hidden_act", "silu"),
        qkv_bias=family == "qwen2" or bool(c.get("attention_bias", False)),
        out_bias=family != "qwen2" and bool(c.get("attention_bias", False)),
        mlp_bias=bool(c.get("mlp_bias", False)), qk_norm=family == "qwen3",
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"), eos_token_id=c.get("eos_token_id"))


# HF name -> our name, for every family laid out like Llama (Gemma reuses the attention and MLP rules).
ATTENTION_MLP_RENAMES = [
    (r"^model\.embed_tokens\.", "embed_tokens."), (r"^model\.norm\.", "norm."),
    (r"^model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.", r"layers.\1.\2_proj."),
    (r"^model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.", r"layers.\1.\2_norm."),
    (r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.", r"layers.\1.\2_proj."),
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attn_norm."),
    (r"^lm_head\.", "lm_head."),
]
LLAMA_RENAMES = ATTENTION_MLP_RENAMES + [
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.mlp_norm."),
]

LLAMA = Family(llama_args, map_simple(LLAMA_RENAMES))
