"""GPT-2: LayerNorm, learned positions, a fused c_attn stored as Conv1D ([in, out]) weights."""
from __future__ import annotations

import re

import torch

from specdecode.models.families.base import Family, rename
from specdecode.models.model import ModelArgs


def gpt2_args(c: dict, family: str) -> ModelArgs:
    h, heads = c["n_embd"], c["n_head"]
    return ModelArgs(
        family=family, vocab_size=c["vocab_size"], hidden_size=h, num_layers=c["n_layer"], num_heads=heads,
        num_kv_heads=heads, head_dim=h // heads, intermediate_size=c.get("n_inner") or 4 * h,
        max_position_embeddings=c.get("n_positions", 1024), norm="layer",
        norm_eps=c.get("layer_norm_epsilon", 1e-5), positions="learned", gated_mlp=False,
        activation=c.get("activation_function", "gelu_new"), qkv_bias=True, out_bias=True, mlp_bias=True,
        tie_embeddings=True, bos_token_id=c.get("bos_token_id"), eos_token_id=c.get("eos_token_id"))


_GPT2_RENAMES = [
    (r"^(transformer\.)?wte\.", "embed_tokens."), (r"^(transformer\.)?wpe\.", "embed_positions."),
    (r"^(transformer\.)?ln_f\.", "norm."),
    (r"^(transformer\.)?h\.(\d+)\.ln_1\.", r"layers.\2.attn_norm."),
    (r"^(transformer\.)?h\.(\d+)\.ln_2\.", r"layers.\2.mlp_norm."),
    (r"^(transformer\.)?h\.(\d+)\.attn\.c_attn\.", r"layers.\2.c_attn."),
    (r"^(transformer\.)?h\.(\d+)\.attn\.c_proj\.", r"layers.\2.o_proj."),
    (r"^(transformer\.)?h\.(\d+)\.mlp\.c_fc\.", r"layers.\2.up_proj."),
    (r"^(transformer\.)?h\.(\d+)\.mlp\.c_proj\.", r"layers.\2.down_proj."),
    (r"^lm_head\.", "lm_head."),
]


def map_gpt2(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    new = rename(_GPT2_RENAMES, name)
    if new is None or name.endswith((".attn.bias", ".attn.masked_bias")):
        return []
    if re.search(r"\.(c_attn|o_proj|up_proj|down_proj)\.weight$", new):
        t = t.t()  # GPT-2 stores Conv1D weights as [in, out]
    if ".c_attn." in new:
        prefix, kind = new.split(".c_attn.")
        return [(f"{prefix}.{p}_proj.{kind}", part) for p, part in zip("qkv", t.chunk(3, dim=0))]
    return [(new, t)]


GPT2 = Family(gpt2_args, map_gpt2)
