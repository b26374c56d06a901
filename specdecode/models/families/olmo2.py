"""OLMo 2 (Olmo2ForCausalLM), after transformers' modeling_olmo2.py: no norms before attention or the MLP, an
RMSNorm on each of their outputs before the residual add, and q/k RMSNorms over the whole q and k projections
(all heads at once, before the split into heads and the rotation).

llama.cpp writes it as ``olmo2``: Llama's names plus post_attention_norm / post_ffw_norm, Q/K rows as HF has them.
"""
from __future__ import annotations

import dataclasses

from specdecode.models.families.base import Family, GGUFArch, map_simple
from specdecode.models.families.llama import ATTENTION_MLP_RENAMES, llama_args
from specdecode.models.model import ModelArgs


def olmo2_args(c: dict, family: str) -> ModelArgs:
    return dataclasses.replace(llama_args(c, family), pre_norms=False, sandwich_norms=True, qk_norm=True,
                               qk_norm_whole=True)


_OLMO2_RENAMES = ATTENTION_MLP_RENAMES + [
    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.post_attn_norm."),
    (r"^model\.layers\.(\d+)\.post_feedforward_layernorm\.", r"layers.\1.post_mlp_norm."),
]

OLMO2 = Family(olmo2_args, map_simple(_OLMO2_RENAMES))

GGUF_ARCHS = {"olmo2": GGUFArch(
    "Olmo2ForCausalLM", {"post_attention_norm.weight": "post_attention_layernorm.weight",
                         "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    lambda name: None, lambda get, c: c)}
