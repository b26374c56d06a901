"""Granite 3 (GraniteForCausalLM): Llama's layout with four scalar multipliers (transformers' modeling_granite.py):
embeddings times embedding_multiplier, attention scores scaled by attention_multiplier (in place of
head_dim ** -0.5), each attention and MLP output times residual_multiplier before the residual add, and the logits
divided by logits_scaling.

llama.cpp writes it as ``granite``: Llama's tensors (Q/K rows permuted as for Llama) and the multipliers as
``granite.embedding_scale``, ``.attention.scale``, ``.residual_scale`` and ``.logit_scale``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from specdecode.models.families.base import Family, GGUFArch, map_simple
from specdecode.models.families.llama import LLAMA_RENAMES, llama_args
from specdecode.models.model import ModelArgs


def _unless_one(x: Any) -> float | None:
    """A multiplier, or None where it is 1 (multiplying or dividing by 1 changes no value)."""
    return None if x is None or float(x) == 1.0 else float(x)


def granite_args(c: dict, family: str) -> ModelArgs:
    return dataclasses.replace(
        llama_args(c, family), attn_scale=float(c.get("attention_multiplier", 1.0)),
        embed_scale=_unless_one(c.get("embedding_multiplier")), residual_scale=_unless_one(c.get("residual_multiplier")),
        logit_divisor=_unless_one(c.get("logits_scaling")))


GRANITE = Family(granite_args, map_simple(LLAMA_RENAMES))


def _gguf_config(get: Callable[..., Any], c: dict) -> dict:
    """llama.cpp leaves out a multiplier of 0 and scales attention by head_dim ** -0.5 without one."""
    return {**c, "embedding_multiplier": get("embedding_scale", 1.0), "residual_multiplier": get("residual_scale", 1.0),
            "attention_multiplier": get("attention.scale") or c["head_dim"] ** -0.5,
            "logits_scaling": get("logit_scale", 1.0)}


GGUF_ARCHS = {"granite": GGUFArch("GraniteForCausalLM", {}, lambda name: None, _gguf_config, rope_permuted=True)}
