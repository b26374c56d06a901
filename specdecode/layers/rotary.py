"""Rotary position embedding (HF's rotate-half layout), with llama3, linear and longrope (Phi-3) scaling, over all
of each head or its leading dims (partial rotary)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn


def _longrope(rot_dim: int, theta: float, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: per-frequency divisors, the long set when the context (max_model_len) runs past the
    pretraining length, else the short one, and cos / sin times an attention factor. HF switches sets by the
    current sequence length instead, which would change the keys already cached once a sequence grows past that
    length; llama.cpp chooses by its context size, as here, so a position's rotation never depends on the batch."""
    old = int(s["original_max_position_embeddings"])
    factors = s["long_factor"] if max_pos > old else s["short_factor"]
    if len(factors) != rot_dim // 2:
        raise ValueError(f"longrope factors have {len(factors)} entries, expected {rot_dim // 2} (rotary dims / 2).")
    shape = torch.arange(0, rot_dim, 2, dtype=torch.int64, device="cpu").float() / rot_dim
    inv = 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * theta ** shape)
    attn = s.get("attention_factor")
    if attn is None:  # HF's default, from the context extension factor (max / original positions)
        factor = float(s["factor"])
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    return inv, float(attn)


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
    raise ValueError(f"Unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, longrope.")


class Rotary(nn.Module):
    def __init__(self, rot_dim: int, max_pos: int, theta: float, scaling: dict | None):
        super().__init__()
        # The tables are computed on the CPU even inside a ``torch.device("meta")`` block (the loader builds
        # models there): they are small, and meta arithmetic would pull in torch's compiler stack at import cost.
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if kind in ("longrope", "su"):
            inv, attn = _longrope(rot_dim, theta, scaling, max_pos)
        else:
            inv, attn = _inv_freq(rot_dim, theta, scaling), 1.0
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32, device="cpu"), inv)
        cos = torch.cat([freqs, freqs], dim=-1).cos()
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: the sign lives in the table (exact), so a
        # rotation is one roll and three elementwise ops instead of two slices, a negation and a cat.
        sin = torch.cat([-freqs, freqs], dim=-1).sin()
        if attn != 1.0:  # as HF: the tables times the factor
            cos, sin = cos * attn, sin * attn
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin_signed", sin, persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [N, 1, head_dim] for positions [N]: looked up once per forward, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim] rotated by the per-token angles in cos / sin_signed [N, 1, head_dim] (HF's
    rotate-half layout: x * cos + rotate_half(x) * sin). With tables narrower than the head (partial rotary), the
    leading dims rotate and the rest pass unchanged."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + x.roll(r // 2, -1) * sin_signed
    rot = x[..., :r]
    return torch.cat([rot * cos + rot.roll(r // 2, -1) * sin_signed, x[..., r:]], dim=-1)
