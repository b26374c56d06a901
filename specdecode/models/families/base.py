"""What every family module provides, and the helpers they share to read configs and rename tensors."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from specdecode.models.model import ModelArgs

WeightMap = Callable[[str, torch.Tensor], "list[tuple[str, torch.Tensor]]"]
Renames = list[tuple[str, str]]


@dataclass
class Family:
    """make_args reads an HF config (dict) into the decoder's ModelArgs; map_weight turns one checkpoint
    tensor into our parameters (none, one, or several for a fused tensor)."""
    make_args: Callable[[dict, str], ModelArgs]
    map_weight: WeightMap


@dataclass
class GGUFArch:
    """How llama.cpp writes a family that models.gguf_loader otherwise reads as it reads Llama."""
    hf_architecture: str
    renames: dict[str, str]                         # per-block GGUF names -> HF names, beside or over Llama's
    transform: Callable[[str], Callable[[torch.Tensor], torch.Tensor] | None]  # HF name -> its tensor's fix
    config: Callable[[Callable[..., Any], dict], dict]  # (metadata getter, the Llama-style config) -> config
    chat_template: str | None = None                # for files that carry none (the family's own format)
    rope_permuted: bool = False                     # Q/K rows reordered for llama.cpp's rope, as for Llama


def rope_params(c: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the classic keys or transformers 5's ``rope_parameters``."""
    rp = c.get("rope_parameters") or {}
    theta = c.get("rope_theta") or rp.get("rope_theta") or 10000.0
    scaling = c.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else None)
    return float(theta), scaling


def rename(rules: Renames, name: str) -> str | None:
    """``name`` rewritten by the first rule whose pattern matches it, or None when none does."""
    for pat, rep in rules:
        if re.match(pat, name):
            return re.sub(pat, rep, name)
    return None


def map_simple(rules: Renames) -> WeightMap:
    """A weight map that only renames (tensors pass unchanged; unmatched names are dropped)."""
    def mapper(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        new = rename(rules, name)
        return [] if new is None else [(new, t)]
    return mapper
