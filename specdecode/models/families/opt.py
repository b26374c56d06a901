"""OPT: LayerNorm, learned positions (stored shifted by 2), a plain ReLU MLP, biases everywhere."""
from __future__ import annotations

from specdecode.models.families.base import Family, map_simple
from specdecode.models.model import ModelArgs


def opt_args(c: dict, family: str) -> ModelArgs:
    if not c.get("do_layer_norm_before", True) or c.get("word_embed_proj_dim", c["hidden_size"]) != c["hidden_size"]:
        raise ValueError("This OPT variant (post-layer-norm or projected embeddings, e.g. opt-350m) is not "
                         "supported; the other OPT sizes (125m, 1.3b, 2.7b, 6.7b, ...) are.")
    h, heads = c["hidden_size"], c["num_attention_heads"]
    return ModelArgs(
        family=family, vocab_size=c["vocab_size"], hidden_size=h, num_layers=c["num_hidden_layers"],
        num_heads=heads, num_kv_heads=heads, head_dim=h // heads, intermediate_size=c["ffn_dim"],
        max_position_embeddings=c.get("max_position_embeddings", 2048), norm="layer", norm_eps=1e-5,
        positions="learned", position_offset=2, gated_mlp=False,
        activation=c.get("activation_function", "relu"), qkv_bias=c.get("enable_bias", True),
        out_bias=c.get("enable_bias", True), mlp_bias=c.get("enable_bias", True),
        tie_embeddings=c.get("tie_word_embeddings", True),
        bos_token_id=c.get("bos_token_id"), eos_token_id=c.get("eos_token_id"))


_OPT_RENAMES = [
    (r"^(model\.)?decoder\.embed_tokens\.", "embed_tokens."),
    (r"^(model\.)?decoder\.embed_positions\.", "embed_positions."),
    (r"^(model\.)?decoder\.final_layer_norm\.", "norm."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.", r"layers.\2.\3_proj."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"layers.\2.o_proj."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"layers.\2.attn_norm."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.final_layer_norm\.", r"layers.\2.mlp_norm."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.fc1\.", r"layers.\2.up_proj."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.fc2\.", r"layers.\2.down_proj."),
    (r"^lm_head\.", "lm_head."),
]

OPT = Family(opt_args, map_simple(_OPT_RENAMES))
