"""Qwen2-MoE and Qwen3-MoE: Qwen2's (q/k/v biases) and Qwen3's (q/k norms) attention with sparse mixtures of
experts (layers.moe) in the layers ``decoder_sparse_step`` and ``mlp_only_layers`` pick, the others keeping a
dense MLP. Qwen2-MoE adds a shared expert that every token runs, scaled by a sigmoid gate; Qwen3-MoE renormalizes
the top-k weights (``norm_topk_prob``) where Qwen2-MoE's releases do not."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch

from specdecode.layers.moe import MoEArgs
from specdecode.models.families.base import Family, GGUFArch, map_simple
from specdecode.models.families.llama import LLAMA_RENAMES, llama_args
from specdecode.models.model import ModelArgs


def sparse_layers(c: dict) -> tuple[bool, ...]:
    """Which layers have experts, as transformers decides: not in mlp_only_layers, and every
    decoder_sparse_step-th layer."""
    n, step = c["num_hidden_layers"], int(c.get("decoder_sparse_step") or 1)
    dense = set(c.get("mlp_only_layers") or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))


def qwen_moe_args(c: dict, family: str) -> ModelArgs:
    a = llama_args(c, "qwen2" if family == "qwen2_moe" else "qwen3")
    experts = int(c.get("num_experts") or c.get("num_local_experts") or 0)
    if c.get("use_sliding_window"):
        raise ValueError(f"{family} with use_sliding_window is not supported.")
    if not experts:
        return replace(a, family=family)  # no experts at all: the dense model
    moe = MoEArgs(num_experts=experts, top_k=int(c["num_experts_per_tok"]),
                  intermediate_size=int(c["moe_intermediate_size"]),
                  norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                  shared_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0)
                  if family == "qwen2_moe" else 0,
                  sparse_layers=sparse_layers(c))
    return replace(a, family=family, moe=moe)


_QWEN_MOE_RENAMES = [
    (r"^model\.layers\.(\d+)\.mlp\.gate\.", r"layers.\1.moe.router."),
    (r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.", r"layers.\1.moe.experts.\2.\3_proj."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert\.(gate|up|down)_proj\.", r"layers.\1.moe.shared.\2_proj."),
    (r"^model\.layers\.(\d+)\.mlp\.shared_expert_gate\.", r"layers.\1.moe.shared_gate."),
] + LLAMA_RENAMES

QWEN_MOE = Family(qwen_moe_args, map_simple(_QWEN_MOE_RENAMES))


# ---- GGUF, as llama.cpp's convert_hf_to_gguf.py writes them: the experts of a layer stacked in one 3-D tensor
# per projection (models.gguf_loader splits them), the shared expert as *_shexp, its gate as ffn_gate_inp_shexp.
_GGUF_RENAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}


def _gguf_transform(hf_name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    # the shared expert's gate is one output channel: a [hidden] vector in llama.cpp's layout
    return (lambda t: t.reshape(1, -1)) if hf_name.endswith("shared_expert_gate.weight") else None


def _gguf_config(norm_default: bool) -> Callable[[Callable[..., Any], dict], dict]:
    def config(get: Callable[..., Any], c: dict) -> dict:
        # llama.cpp renormalizes the top-k weights of qwen3moe and not those of qwen2moe, unless the file says
        return {**c, "norm_topk_prob": bool(get("expert_weights_norm", norm_default))}
    return config


GGUF_ARCHS = {
    "qwen2moe": GGUFArch("Qwen2MoeForCausalLM", _GGUF_RENAMES, _gguf_transform, _gguf_config(False)),
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", _GGUF_RENAMES, _gguf_transform, _gguf_config(True)),
}
