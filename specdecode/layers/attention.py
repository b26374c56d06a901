"""Attention over a preallocated KV cache.

Tokens arrive flattened: token i belongs to cache slot ``slots[i]`` at position ``positions[i]``.
Prefill (one whole prompt) runs one causal SDPA call. Decode and verification rows run one SDPA call
per token over exactly that token's prefix, so a token's output is bitwise the same whether it is
decoded alone or verified together with drafts or other requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdecode.layers.kernels import KEY_TILE


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor      # [N]
    positions: torch.Tensor      # [N]
    slots: torch.Tensor          # [N] cache slot of each token
    slot_list: list[int]         # the same, as Python ints (no device syncs in the per-token loop)
    pos_list: list[int]
    prefill: bool                # one sequence, all of its new tokens causal among themselves
    logits_rows: torch.Tensor    # rows whose logits the caller wants
    _runs: list[tuple[int, int, int, int]] | None = field(default=None, repr=False)

    def runs(self) -> list[tuple[int, int, int, int]]:
        """(slot, first position, first row, end row) for each stretch of consecutive positions of one slot."""
        if self._runs is None:
            runs: list[tuple[int, int, int, int]] = []
            for i, (slot, pos) in enumerate(zip(self.slot_list, self.pos_list)):
                if runs and runs[-1][0] == slot and runs[-1][1] + (i - runs[-1][2]) == pos:
                    runs[-1] = (slot, runs[-1][1], runs[-1][2], i + 1)
                else:
                    runs.append((slot, pos, i, i + 1))
            self._runs = runs
        return self._runs


class Attention(nn.Module):
    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.scale = n_heads, n_kv_heads, head_dim, scale
        self.k_cache: torch.Tensor | None = None  # [slots, kv_heads, max_len, head_dim], bound by the engine
        self.v_cache: torch.Tensor | None = None
        # The keys once more where the C++ layer stack runs (kernels.LayerStack), in transposed tiles of
        # KEY_TILE positions ([slots, kv_heads, tiles, head_dim, KEY_TILE]): its decode attention reads each
        # tile of keys as one contiguous block.
        self.kt_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        """q: [N, H, D]; k, v: [N, KV, D] -> [N, H*D]."""
        kc, vc = self.k_cache, self.v_cache
        # Slice copies per stretch of positions: far cheaper than one scattered index_put per layer.
        for slot, p0, i0, i1 in b.runs():
            kc[slot, :, p0:p0 + i1 - i0] = k[i0:i1].transpose(0, 1)
            vc[slot, :, p0:p0 + i1 - i0] = v[i0:i1].transpose(0, 1)
            if self.kt_cache is not None:
                p = torch.arange(p0, p0 + i1 - i0, device=k.device)
                self.kt_cache[slot].permute(1, 3, 0, 2)[p // KEY_TILE, p % KEY_TILE] = k[i0:i1]
        n, rep = q.shape[0], self.n_heads // self.n_kv
        if b.prefill:
            slot, start = b.slot_list[0], b.pos_list[0]
            end = start + n
            keys = kc[slot, :, :end].to(q.dtype)
            vals = vc[slot, :, :end].to(q.dtype)
            if rep > 1:
                keys, vals = keys.repeat_interleave(rep, 0), vals.repeat_interleave(rep, 0)
            qh = q.transpose(0, 1)
            if start == 0:
                out = F.scaled_dot_product_attention(qh, keys, vals, is_causal=True, scale=self.scale)
            else:
                allowed = torch.arange(end, device=q.device)[None, :] <= b.positions[:, None]
                out = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=allowed, scale=self.scale)
            return out.transpose(0, 1).reshape(n, -1)
        out = torch.empty(n, self.n_kv, rep, self.head_dim, dtype=q.dtype, device=q.device)
        # The rep query heads that share a KV head act as rep query rows: no K/V copy for GQA. Inputs are
        # 4-D so that SDPA can take its fused kernel (3-D inputs fall back to the slower unfused path).
        qg = q.view(n, 1, self.n_kv, rep, self.head_dim)
        for i, (slot, pos) in enumerate(zip(b.slot_list, b.pos_list)):
            out[i] = F.scaled_dot_product_attention(
                qg[i], kc[slot:slot + 1, :, :pos + 1].to(q.dtype), vc[slot:slot + 1, :, :pos + 1].to(q.dtype),
                scale=self.scale)[0]
        return out.view(n, -1)
