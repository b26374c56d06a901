"""Rotary position embedding (HF's rotate-half layout), with llama3 and linear scaling."""
from __future__ import annotations

import math

import torch
import torch.nn as nn


def _inv_freq(rot_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_len / lo, old_len / hi
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"Unsupported rope_scaling type {kind!r}; supported: default, linear, llama3.")


class Rotary(nn.Module):
    def __init__(self, rot_dim: int, max_pos: int, theta: float, scaling: dict | None):
        super().__init__()
        # The tables are computed on the CPU even inside a ``torch.device("meta")`` block (the loader builds
        # models there): they are small, and meta arithmetic would pull in torch's compiler stack at import cost.
        inv = _inv_freq(rot_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32, device="cpu"), inv)
        self.register_buffer("cos", torch.cat([freqs, freqs], dim=-1).cos(), persistent=False)
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: the sign lives in the table (exact), so a
        # rotation is one roll and three elementwise ops instead of two slices, a negation and a cat.
        self.register_buffer("sin_signed", torch.cat([-freqs, freqs], dim=-1).sin(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [N, 1, head_dim] for positions [N]: looked up once per forward, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim] rotated by the per-token angles in cos / sin_signed [N, 1, head_dim] (HF's
    rotate-half layout: x * cos + rotate_half(x) * sin)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed
