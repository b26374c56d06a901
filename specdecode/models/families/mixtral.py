"""Mixtral: Llama's attention with a sparse mixture of experts in every layer (layers.moe): a softmax router, the
top ``num_experts_per_tok`` of ``num_local_experts`` experts, their weights renormalized to sum to 1.

llama.cpp writes it as the ``llama`` architecture with expert tensors (models.gguf_loader reads those as this
family)."""
from __future__ import annotations

from dataclasses import replace

from specdecode.layers.moe import MoEArgs
from specdecode.models.families.base import Family, map_simple
from specdecode.models.families.llama import LLAMA_RENAMES, llama_args
from specdecode.models.families.mistral import sliding_from_config
from specdecode.models.model import ModelArgs


def mixtral_args(c: dict, family: str) -> ModelArgs:
    a = llama_args(c, family)
    window, sliding = sliding_from_config(c, per_layer=False)  # Mistral's window: every layer, where set
    moe = MoEArgs(num_experts=int(c["num_local_experts"]), top_k=int(c["num_experts_per_tok"]),
                  intermediate_size=a.intermediate_size, norm_topk_prob=True)
    return replace(a, moe=moe, sliding_window=window, sliding_layers=sliding)


_MIXTRAL_RENAMES = [
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.", r"layers.\1.moe.router."),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.", r"layers.\1.moe.experts.\2.gate_proj."),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w3\.", r"layers.\1.moe.experts.\2.up_proj."),
    (r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w2\.", r"layers.\1.moe.experts.\2.down_proj."),
] + LLAMA_RENAMES

MIXTRAL = Family(mixtral_args, map_simple(_MIXTRAL_RENAMES))
