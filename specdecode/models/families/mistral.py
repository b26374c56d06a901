"""Mistral and Ministral: Llama's layout with sliding-window attention.

Mistral (MistralForCausalLM) attends within ``sliding_window`` on every layer when the config sets one (and like
Llama without it: it then runs on the C++ layer stack); transformers ignores ``layer_types`` for it. Ministral
(MinistralForCausalLM) reads ``layer_types``, which interleave sliding and full layers.

llama.cpp writes both as ``llama``, without the window (it runs them with full attention); a ``llama`` GGUF whose
metadata has ``llama.attention.sliding_window`` reads back as Mistral, or as Ministral where a per-layer
``sliding_window_pattern`` comes with it (models.gguf_loader).
"""
from __future__ import annotations

import dataclasses

from specdecode.models.families.base import Family, map_simple
from specdecode.models.families.llama import LLAMA_RENAMES, llama_args
from specdecode.models.model import ModelArgs


def sliding_from_config(c: dict, per_layer: bool) -> tuple[int | None, tuple[bool, ...]]:
    """(window, which layers slide): every layer when the config has a window, or those ``layer_types`` marks
    (per_layer) where it lists them."""
    window, n = c.get("sliding_window"), c["num_hidden_layers"]
    if not window:
        return None, ()
    types = c.get("layer_types") if per_layer else None
    if not types:
        return int(window), (True,) * n
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != n:
        raise ValueError(f"Unsupported layer_types {sorted(unknown) or len(types)} in this config "
                         f"({n} layers, each sliding_attention or full_attention).")
    sliding = tuple(t == "sliding_attention" for t in types)
    return (int(window), sliding) if any(sliding) else (None, ())


def mistral_args(c: dict, family: str) -> ModelArgs:
    window, sliding = sliding_from_config(c, per_layer=family == "ministral")
    return dataclasses.replace(llama_args(c, family), sliding_window=window, sliding_layers=sliding)


MISTRAL = Family(mistral_args, map_simple(LLAMA_RENAMES))
