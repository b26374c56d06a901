"""Phi-3 and Phi-4 (Phi3ForCausalLM), after transformers' modeling_phi3.py: Llama's blocks with

- fused ``qkv_proj`` and ``gate_up_proj`` tensors, split here into our q/k/v and gate/up parameters (the loader
  concatenates them again into its fused linears, so the values are the checkpoint's own);
- LongRoPE (``longrope``, formerly ``su``) with short and long per-frequency factors and an attention factor
  (layers.rotary), and a partial rotary factor (Phi-4-mini rotates 3/4 of each head);
- a sliding window over every layer where the config sets one (Phi-3-mini; not Phi-4).

llama.cpp writes it as ``phi3``: attn_qkv and a fused ffn_up, the LongRoPE factors as rope_factors_long /
rope_factors_short tensors (models.gguf_loader folds them into the config), Q/K rows as HF has them.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch

from specdecode.models.families.base import Family, GGUFArch, rename, rope_params
from specdecode.models.families.llama import LLAMA_RENAMES, llama_args
from specdecode.models.families.mistral import sliding_from_config
from specdecode.models.model import ModelArgs


def _scaling(c: dict, rp: dict, scaling: dict | None) -> dict | None:
    """HF's rope parameters as layers.rotary reads them: longrope with its factors, the pretraining length and
    the extension factor (transformers treats Phi-3's ``su`` and ``yarn`` as longrope too)."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("longrope", "su", "yarn"):
        raise ValueError(f"Unsupported rope scaling {kind!r} for Phi-3 (only longrope / su).")
    old = int(scaling.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings")
              or c.get("original_max_position_embeddings") or c["max_position_embeddings"])
    factor = scaling.get("factor") or c["max_position_embeddings"] / old
    return {"rope_type": "longrope", "long_factor": list(scaling["long_factor"]),
            "short_factor": list(scaling["short_factor"]), "original_max_position_embeddings": old,
            "factor": float(factor), "attention_factor": scaling.get("attention_factor")}


def phi3_args(c: dict, family: str) -> ModelArgs:
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    head_dim = c.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:  # map_phi3 splits the fused qkv rows by the hidden size
        raise ValueError(f"Phi-3 with head_dim * heads ({head_dim} * {heads}) != hidden_size ({hidden}) "
                         "is not supported.")
    rp = c.get("rope_parameters") or {}
    theta, scaling = rope_params(c)
    partial = float(rp.get("partial_rotary_factor") or c.get("partial_rotary_factor") or 1.0)
    window, sliding = sliding_from_config(c, per_layer=False)
    return dataclasses.replace(
        llama_args({**c, "head_dim": head_dim}, family), rope_theta=theta, rope_scaling=_scaling(c, rp, scaling),
        rotary_dim=int(head_dim * partial), sliding_window=window, sliding_layers=sliding)


_FUSED = re.compile(r"^model\.layers\.(\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$")  # no biases


def map_phi3(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    m = _FUSED.match(name)
    if m is None:
        new = rename(LLAMA_RENAMES, name)
        return [] if new is None else [(new, t)]
    layer, which = m.groups()
    if which == "mlp.gate_up_proj":  # [gate; up], as HF's chunk(2) reads it
        gate, up = t.chunk(2, dim=0)
        return [(f"layers.{layer}.gate_proj.weight", gate), (f"layers.{layer}.up_proj.weight", up)]
    # rows [q; k; v]: q has as many rows as the hidden size (phi3_args checks it), k and v share the rest
    kv = (t.shape[0] - t.shape[1]) // 2
    q, k, v = t.split([t.shape[0] - 2 * kv, kv, kv], dim=0)
    return [(f"layers.{layer}.{p}_proj.weight", x) for p, x in zip("qkv", (q, k, v))]


PHI3 = Family(phi3_args, map_phi3)


def _gguf_config(get: Callable[..., Any], c: dict) -> dict:
    """llama.cpp's phi3 keys: the rotated dims per head, and a sliding window of 0 for none (Phi-4)."""
    rope_dims = int(get("rope.dimension_count", c["head_dim"]))
    return {**c, "partial_rotary_factor": rope_dims / c["head_dim"],
            "sliding_window": get("attention.sliding_window") or None}


GGUF_ARCHS = {"phi3": GGUFArch("Phi3ForCausalLM", {"attn_qkv.weight": "self_attn.qkv_proj.weight",
                                                   "ffn_up.weight": "mlp.gate_up_proj.weight"},
                               lambda name: None, _gguf_config)}
