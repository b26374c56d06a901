"""Linear layers whose output row never depends on which other rows share the call.

Why: speculative verification scores k+1 tokens in one pass while plain decoding scores one. BLAS picks
different kernels for different row counts, so the same token could get slightly different logits and
greedy outputs could diverge. On CPU every model pass therefore goes through our row-invariant kernel
(layers/kernels/): decode and verification rows, and prefill too, whose blocks are shared between requests by
the prefix cache and must not depend on how a prompt was split into chunks.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdecode.layers import kernels

_state = threading.local()


@contextlib.contextmanager
def row_invariant(enabled: bool = True):
    """Within this block, CPU linears use the row-invariant kernel."""
    prev = getattr(_state, "on", False)
    _state.on = enabled
    try:
        yield
    finally:
        _state.on = prev


# Rows packed per pack_linear call: its temporaries (int16 / int8 copies, the interleave) scale with the rows it
# is given, so a 150k-row head is packed a slice at a time into its final buffers. A multiple of the kernels'
# 16-channel groups; every format quantizes each row on its own, so the bytes do not depend on the slicing.
PACK_ROWS = 8192


def pack_in_chunks(weight: torch.Tensor, fmt: str, rows: int = PACK_ROWS) -> kernels.PackedLinear:
    """``kernels.pack_linear(weight, fmt)``, bitwise, with temporary memory bounded by ``rows`` rows."""
    N, K = weight.shape
    if N <= rows or fmt == "fp32":
        return kernels.pack_linear(weight, fmt)
    return pack_row_slices(lambda n0, n1: weight[n0:n1], N, K, fmt, rows)


def pack_row_slices(rows_of: Callable[[int, int], torch.Tensor], N: int, K: int, fmt: str,
                    rows: int = PACK_ROWS) -> kernels.PackedLinear:
    """``pack_in_chunks`` of a ``[N, K]`` weight given a slice at a time (``rows_of(n0, n1)``: rows [n0, n1)), so
    that the whole weight need never exist at full precision (a GGUF head decoded slice by slice)."""
    if fmt == "fp32":
        raise ValueError("pack_row_slices: fp32 weights are used as they are, not packed")
    if rows % kernels.W8A8_GROUP:
        raise ValueError(f"pack_row_slices: rows must be a multiple of {kernels.W8A8_GROUP}")
    grouped = fmt in kernels.INT_ACTS  # leading dim counts 16-channel groups, not channels
    unit = kernels.W8A8_GROUP if grouped else 1
    s_unit = unit if fmt in kernels.GROUPED_SCALES else 1  # their codes and units are per group too; other scales per channel
    weight_out = scale_out = None
    for n0 in range(0, N, rows):
        part = kernels.pack_linear(rows_of(n0, min(N, n0 + rows)), fmt)
        if weight_out is None:
            weight_out = part.weight.new_empty((-(-N // unit), *part.weight.shape[1:]))
            if part.scale is not None:
                scale_out = part.scale.new_empty((-(-N // s_unit), *part.scale.shape[1:]))
        weight_out[n0 // unit:n0 // unit + part.weight.shape[0]] = part.weight
        if scale_out is not None:
            scale_out[n0 // s_unit:n0 // s_unit + part.scale.shape[0]] = part.scale
    return kernels.PackedLinear(fmt, weight_out, scale_out, K, N)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: kernels.PackedLinear | None = None

    @classmethod
    def concat(cls, parts: list["Linear"]) -> "Linear":
        """One linear whose output is the parts' outputs side by side (weights not yet prepared)."""
        bias = [p.bias for p in parts]
        if any(b is not None for b in bias):
            bias = [b if b is not None else torch.zeros(p.out_features, dtype=p.weight.dtype, device=p.weight.device)
                    for b, p in zip(bias, parts)]
        with torch.device("meta"):  # no throwaway allocation: the tensors are assigned below
            out = cls(parts[0].in_features, sum(p.out_features for p in parts), bias=bias[0] is not None)
        if all(p.weight.is_meta for p in parts):  # a model skeleton (the packed cache's loader): shapes only
            return out  # (a cat of meta tensors would import torch's compiler stack, seconds of start-up)
        out.weight = nn.Parameter(torch.cat([p.weight.data for p in parts]), requires_grad=False)
        if out.bias is not None:
            out.bias = nn.Parameter(torch.cat([b.data for b in bias]), requires_grad=False)
        return out

    def select_rows(self, rows: torch.Tensor) -> "Linear":
        """A linear computing only output channels ``rows`` (in that order), in the same prepared format."""
        with torch.device("meta"):
            out = type(self)(self.in_features, len(rows), bias=self.bias is not None)
        out.weight = (nn.Parameter(self.weight.data[rows.to(self.weight.device)].clone(), requires_grad=False)
                      if self.weight is not None else None)
        if self.bias is not None:
            out.bias = nn.Parameter(self.bias.data[rows.to(self.bias.device)].clone(), requires_grad=False)
        out.packed = self.packed.select_rows(rows.to(self.packed.device)) if self.packed is not None else None
        return out

    def prepare(self, quantization: str | None) -> None:
        """Pack the loaded weight for the CPU kernel; int8 drops the float copy to save memory."""
        if self.weight.device.type != "cpu":
            return
        fmt = quantization if quantization in kernels.QUANTIZED else {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(
            self.weight.dtype, "fp32")
        w = self.weight.data if fmt != "fp32" or self.weight.dtype == torch.float32 else self.weight.data.float()
        self.set_packed(kernels.pack_linear(w, fmt) if fmt == "fp32" else pack_in_chunks(w, fmt))

    def set_packed(self, packed: kernels.PackedLinear) -> None:
        """Use ``packed`` (this linear's weight, already in a kernel format) for the CPU kernel."""
        fmt = packed.fmt
        self.packed = packed
        if self.bias is not None:
            self.bias.data = self.bias.data.float()
        if fmt != "fp32":
            self.weight = None  # the kernel owns the only copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.device.type == "cpu":
            compiling = torch.compiler.is_compiling()  # CausalLM.compile_decode: only decode / verify rows
            if compiling or getattr(_state, "on", False) or self.weight is None:
                shape, p = x.shape, self.packed
                rows = x.reshape(-1, shape[-1]).float().contiguous()
                if compiling:  # the custom op keeps the kernel call inside the compiled graph
                    out = torch.ops.specdecode.rowinv_linear(rows, p.weight, p.scale, self.bias, p.fmt,
                                                             self.out_features)
                else:
                    out = kernels.rowinv_linear(rows, p, self.bias)
                return out.reshape(*shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)
