"""The pure-torch path of rowinv_linear: without the extension (or with it switched off), and on other devices."""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from specdecode.layers.kernels.formats import INT_ACTS
from specdecode.layers.kernels.int8 import quantize_activations
from specdecode.layers.kernels.packed import PackedLinear, _dequantize_rows, dequantize


def _dense_on(packed: PackedLinear, device: torch.device) -> torch.Tensor:
    w = packed._dense_cache.get(device)
    if w is None:
        w = dequantize(packed).to(device)
        packed._dense_cache[device] = w
    return w


def _weight_chunks(packed: PackedLinear, device: torch.device) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(n0, w)`` with ``w`` a float32 ``[n, K]`` slice of the effective weight, in fixed chunks."""
    K, N = packed.in_features, packed.out_features
    if packed.weight.device != device:
        yield 0, _dense_on(packed, device)
    elif packed.fmt == "fp32":
        yield 0, packed.weight[:, :K]
    else:  # dequantize in fixed row chunks: no cached float copy (it would defeat int8/bf16 savings)
        step = max(1, (1 << 22) // max(K, 1))
        for n0 in range(0, N, step):
            yield n0, _dequantize_rows(packed, n0, n0 + step)


def _fallback(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None) -> torch.Tensor:
    """Pure torch, row by row: every output row comes from its own M=1 call, so it is row-invariant
    (independence from the thread count is up to the BLAS library here)."""
    M = x.shape[0]
    if packed.fmt in INT_ACTS:
        x = quantize_activations(x)
    out = torch.empty(M, packed.out_features, dtype=torch.float32, device=x.device)
    for n0, w in _weight_chunks(packed, x.device):
        n1 = n0 + w.shape[0]
        for i in range(M):
            out[i:i + 1, n0:n1] = F.linear(x[i:i + 1], w)
    if bias is not None:
        out = out + bias.to(device=out.device, dtype=torch.float32)
    return out
