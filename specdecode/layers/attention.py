"""Attention over the model's paged KV cache (layers.paged_kv; the engine's is engine.kv_cache.KVCache).

Tokens arrive flattened: token i belongs to cache slot ``slots[i]`` at position ``positions[i]``.

This Python path runs the layers of models the C++ layer stack does not cover (models.model); where the
stack runs, prompt rows take it as decode rows do.

Prefill (a stretch of one prompt, or stretches of several prompts in one pass) runs one SDPA call per block
of ``BLOCK_SIZE`` positions of each stretch, aligned at multiples of it: the queries of the block against the
keys up to the block's end. Chunks end on block boundaries (engine.llm_engine), so a position's output
depends only on its own block's call, and a prompt prefilled whole, in chunks, or after a prefix taken from
the cache gets bitwise the same keys, values and logits.

Decode and verification rows run one SDPA call per token over exactly that token's prefix, so a token's
output is bitwise the same whether it is decoded alone or verified together with drafts or other requests.

A sliding-window layer (Gemma) lets the query at position i see keys i - window + 1 .. i: a decode row's call
takes exactly those keys, a prefill block's call the keys from its first row's window start, masked per row.
Which keys a call sees depends only on the positions, so windows keep every property above. Soft-capped
scores (tanh(scores / cap) * cap) take the same calls written out in matmul / softmax, as HF's eager path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdecode.layers.paged_kv import BLOCK_SIZE, PagedKVCache


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor      # [N]
    positions: torch.Tensor      # [N]
    slots: torch.Tensor          # [N] cache slot of each token
    slot_list: list[int]         # the same, as Python ints (no device syncs in the per-token loop)
    pos_list: list[int]
    prefill: bool                # prompt stretches (one per slot), each causal among its own tokens
    logits_rows: torch.Tensor    # rows whose logits the caller wants
    _runs: list[tuple[int, int, int, int]] | None = field(default=None, repr=False)
    _kv_loc: tuple[object, tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)

    def kv_location(self, cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each token's K/V goes in ``cache`` (PagedKVCache.locate), computed once per pass for all layers."""
        if self._kv_loc is None or self._kv_loc[0] is not cache:
            self._kv_loc = (cache, cache.locate(self.slots, self.positions))
        return self._kv_loc[1]

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
    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, scale: float, window: int | None = None,
                 softcap: float | None = None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.scale = n_heads, n_kv_heads, head_dim, scale
        self.window, self.softcap = window, softcap
        # The model's KV cache and this layer's index in it, bound by the engine (bind_kv_cache).
        self.kv_cache: PagedKVCache | None = None
        self.layer_index = 0

    def bind_kv_cache(self, cache: PagedKVCache | None, layer_index: int) -> None:
        self.kv_cache, self.layer_index = cache, layer_index

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: ForwardBatch) -> torch.Tensor:
        """q: [N, H, D]; k, v: [N, KV, D] -> [N, H*D]."""
        cache, layer = self.kv_cache, self.layer_index
        if cache is None:
            raise RuntimeError("Attention has no KV cache bound: build a ModelRunner for this model first.")
        cache.write(layer, b.kv_location(cache), k, v)
        n, rep = q.shape[0], self.n_heads // self.n_kv
        out = torch.empty(n, self.n_kv, rep, self.head_dim, dtype=q.dtype, device=q.device)
        if b.prefill:
            qp = q.view(n, self.n_kv, rep, self.head_dim)
            for slot, start, i0, i1 in b.runs():
                keys, vals = cache.read(layer, slot, start + i1 - i0, q.dtype)
                self._prefill_blocks(qp[i0:i1], keys[None], vals[None], start, out[i0:i1])
            return out.view(n, -1)
        # The rep query heads that share a KV head act as rep query rows: no K/V copy for GQA. Inputs are
        # 4-D so that SDPA can take its fused kernel (3-D inputs fall back to the slower unfused path).
        qg = q.view(n, 1, self.n_kv, rep, self.head_dim)
        for slot, p0, i0, i1 in b.runs():
            # One widened copy of the request's prefix per stretch of rows; each row attends to exactly its own
            # prefix of it. SDPA's result depends on the values and the sequence length only (not on where
            # the buffer ends), so a row's output is the same alone or next to its drafts.
            keys, vals = cache.read(layer, slot, p0 + i1 - i0, q.dtype)
            keys, vals = keys[None], vals[None]
            for i in range(i0, i1):
                end = p0 + i - i0 + 1
                lo = max(0, end - self.window) if self.window else 0
                out[i] = self._sdpa(qg[i], keys[:, :, lo:end], vals[:, :, lo:end], None)[0]
        return out.view(n, -1)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """Attention of q [1, KV, M, D] over k, v [1, KV, L, D]; allowed [M, L] (None: every key)."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        cap = self.softcap
        scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * self.scale / cap) * cap
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)

    def _prefill_blocks(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, start: int,
                        out: torch.Tensor) -> None:
        """Causal attention of positions start .. start + len(q) - 1, one call per aligned block.

        q [n, KV, rep, D]; keys, vals [1, KV, >= start + n, D]; out [n, KV, rep, D]. The rep query heads of a
        KV head are rows of one call (no K/V copy for GQA), position-major, so row r is position r // rep."""
        n, kv, rep, d = q.shape
        end = start + n
        p = start
        while p < end:
            stop = min((p // BLOCK_SIZE + 1) * BLOCK_SIZE, end)
            m = stop - p
            qb = q[p - start:stop - start].permute(1, 0, 2, 3).reshape(1, kv, m * rep, d)
            row_pos = torch.arange(p, stop, device=q.device).repeat_interleave(rep)
            lo = max(0, p - self.window + 1) if self.window else 0  # the first row's window start
            key_pos = torch.arange(lo, stop, device=q.device)[None, :]
            allowed = key_pos <= row_pos[:, None]
            if self.window:
                allowed &= key_pos > row_pos[:, None] - self.window
            o = self._sdpa(qb, keys[:, :, lo:stop], vals[:, :, lo:stop], allowed)
            out[p - start:stop - start] = o[0].view(kv, m, rep, d).permute(1, 0, 2, 3)
            p = stop
