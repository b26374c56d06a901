"""LayerStack: a llama-style model's decoder layers as one table for the extension's decode path
(csrc/layer_stack.cpp)."""
from __future__ import annotations

from typing import Any

import torch

from specdecode.layers.kernels.extension import _get_ext

_LAYER_FIELDS = 8 + 4 * 7  # csrc/layer_stack.h: kLayerFields
KEY_TILE = 16  # csrc/layer_stack.h: kKeyTile, the positions per KV cache block (layers.paged_kv.BLOCK_SIZE)
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}  # csrc/layer_stack.h: KvFmt


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _f32(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype is not torch.float32 or not t.is_cpu or not t.is_contiguous():
        raise ValueError(f"LayerStack: {what} must be a contiguous float32 CPU tensor")
    return t


class LayerStack:
    """The decoder layers of a llama-style model (RMSNorm, rotary, GQA attention, gated SiLU MLP) as one
    table of addresses for the C++ decode path. Holds a reference to every tensor the table points to.

    ``layers``: per layer a dict with ``attn_norm``, ``mlp_norm``, ``q_norm`` / ``k_norm`` (or None), ``keys``
    ([num_blocks, KV, D, KEY_TILE]) and ``values`` ([num_blocks, KV, KEY_TILE, D]), the layer's KV cache blocks
    (engine.kv_cache.KVCache.layer) in float32, float16, bfloat16 or int8 (then also ``key_scales`` and
    ``value_scales``, [num_blocks, KV, KEY_TILE] float32: KVCache.scales), and ``qkv`` / ``o`` / ``gate_up`` / ``down``
    as (PackedLinear, bias or None). ``block_table`` ([slots, blocks_per_slot] int64) maps a slot's positions
    to blocks; it is read at every call, so it may be refilled in place."""

    def __init__(self, layers: list[dict], *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, scale: float, cos: torch.Tensor, sin_signed: torch.Tensor,
                 block_table: torch.Tensor, max_len: int):
        keep: list[Any] = [_f32(cos, "cos"), _f32(sin_signed, "sin")]
        if (block_table.dtype is not torch.int64 or block_table.ndim != 2 or not block_table.is_cpu
                or not block_table.is_contiguous() or block_table.shape[1] * KEY_TILE < max_len):
            raise ValueError(f"LayerStack: block_table must be a contiguous int64 CPU tensor [slots, blocks] "
                             f"covering max_len={max_len} positions")
        kv_dtype = layers[0]["keys"].dtype if layers else torch.float32
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"LayerStack: KV cache dtype {kv_dtype} is not one of float32, float16, bfloat16, int8")
        num_blocks = layers[0]["keys"].shape[0] if layers else 1
        rows = []
        for L in layers:
            keys, values = L["keys"], L["values"]
            want = {"keys": (num_blocks, kv_heads, head_dim, KEY_TILE), "values": (num_blocks, kv_heads, KEY_TILE, head_dim)}
            for name, t in (("keys", keys), ("values", values)):
                if (tuple(t.shape) != want[name] or t.dtype is not kv_dtype or not t.is_cpu
                        or not t.is_contiguous()):
                    raise ValueError(f"LayerStack: {name} must be a contiguous {kv_dtype} CPU tensor {list(want[name])}")
            scales = [L.get("key_scales"), L.get("value_scales")] if kv_dtype is torch.int8 else [None, None]
            for name, t in zip(("key_scales", "value_scales"), scales):
                if kv_dtype is torch.int8 and (t is None or tuple(t.shape) != (num_blocks, kv_heads, KEY_TILE)):
                    raise ValueError(f"LayerStack: an int8 cache needs {name} [{num_blocks}, {kv_heads}, {KEY_TILE}]")
                if t is not None:
                    _f32(t, name)
            row = [_ptr(_f32(L["attn_norm"], "attn_norm")), _ptr(_f32(L["mlp_norm"], "mlp_norm")),
                   *(0 if L[n] is None else _ptr(_f32(L[n], n)) for n in ("q_norm", "k_norm")),
                   _ptr(keys), _ptr(values), *(_ptr(t) for t in scales)]
            keep += [L[k] for k in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "keys", "values")] + scales
            for name in ("qkv", "o", "gate_up", "down"):
                packed, bias = L[name]
                wptr, ldw, code, scale_t = packed._kernel_args()
                if bias is not None:
                    _f32(bias, f"{name} bias")
                row += [code, wptr, ldw, _ptr(scale_t), _ptr(bias), packed.in_features, packed.out_features]
                keep += [packed, packed.weight, scale_t, bias]
            rows.append(row)
        self.table = torch.tensor(rows, dtype=torch.int64).reshape(len(layers), _LAYER_FIELDS)
        self.block_table = block_table
        self._keep = keep
        self._dims = (cos.data_ptr(), sin_signed.data_ptr(), cos.shape[0], hidden, heads, kv_heads, head_dim,
                      intermediate, block_table.shape[0], max_len, float(eps), float(scale), KV_DTYPES[kv_dtype],
                      block_table.data_ptr(), block_table.shape[1], num_blocks)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Runs every layer on x [M, hidden] (float32, updated in place and returned)."""
        ext = _get_ext()
        if ext is None:
            raise RuntimeError("LayerStack needs the compiled kernel")
        x = _f32(x, "x")
        positions = positions.to(device="cpu", dtype=torch.int64).contiguous()
        slots = slots.to(device="cpu", dtype=torch.int64).contiguous()
        hidden = self._dims[3]
        if x.ndim != 2 or x.shape[1] != hidden or positions.shape != (x.shape[0],) or slots.shape != positions.shape:
            raise ValueError("LayerStack: x must be [M, hidden] with M positions and slots")
        cp, sp, npos, *dims = self._dims
        ext.decoder_layers(self.table.data_ptr(), self.table.shape[0], x.data_ptr(), x.shape[0], positions.data_ptr(),
                           slots.data_ptr(), cp, sp, npos, *dims)
        return x
