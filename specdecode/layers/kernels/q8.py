"""q8_0: GGUF Q8_0's blocks as the kernel holds them (``w = d * u`` per block of 32 weights of a channel, u int8,
d fp16), their logical fields, the quantization of float weights to them and the kernel's packed layout.

A Q8_0 tensor's bytes are its fields as they are: nothing is dequantized or requantized on the way to the kernel,
which takes the same integer dot products as w8a8 and scales each block by the weight's d besides the
activation's (csrc/w8a8.cpp)."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from specdecode.layers.kernels.formats import ACT_BLOCK, W8A8_GROUP, _round_up
from specdecode.layers.kernels.int8 import _interleave, _w8a8_rows

if TYPE_CHECKING:
    from specdecode.layers.kernels.packed import PackedLinear

Q8_BLOCK_BYTES = 34  # a GGUF Q8_0 block: an fp16 d, then 32 int8 values


class Q8Fields(NamedTuple):
    """A q8_0 weight in logical form: ``w[n, k] = d[n, k // 32] * u[n, k]``. ``u`` int8 [N, Kp] (any value,
    -128 included), ``d`` float16 [N, Kp / 32]."""
    u: torch.Tensor
    d: torch.Tensor


def q8_0_fields(blocks: torch.Tensor, K: int) -> Q8Fields:
    """A GGUF Q8_0 tensor as stored (uint8 ``[N, K / 32 * 34]``) -> its fields, the very bytes."""
    if K % ACT_BLOCK:
        raise ValueError(f"q8_0_fields: a Q8_0 row holds a multiple of 32 weights, got {K}")
    N, nb = blocks.shape[0], K // ACT_BLOCK
    b = blocks.reshape(N, nb, Q8_BLOCK_BYTES)
    return Q8Fields(b[:, :, 2:].contiguous().view(torch.int8).reshape(N, K),
                    b[:, :, :2].contiguous().view(torch.float16).reshape(N, nb))


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, with the operations gguf-py's ``np_roundf`` uses (so the same values)."""
    a = x.abs()
    f = a.floor()
    return x.sign() * (f + (2 * (a - f)).floor())


def _quantize_q8(w: torch.Tensor) -> Q8Fields:
    """Float weights -> Q8_0 fields as gguf-py (and ggml) quantize them: per block of 32 ``d = absmax / 127``,
    ``u = round_away(w * (1 / d))`` in float32, then d stored as fp16."""
    N, K = w.shape
    Kp = _round_up(K, ACT_BLOCK)
    u = torch.empty(N, Kp, dtype=torch.int8, device=w.device)
    d = torch.empty(N, Kp // ACT_BLOCK, dtype=torch.float16, device=w.device)
    step = max(1, (1 << 20) // Kp)
    for n0 in range(0, N, step):
        x = F.pad(w[n0:n0 + step].float(), (0, Kp - K))
        blk = x.view(x.shape[0], -1, ACT_BLOCK)
        dd = blk.abs().amax(dim=2, keepdim=True) / 127
        inv = torch.where(dd == 0, torch.zeros_like(dd), 1 / dd)
        u[n0:n0 + step] = _round_away(blk * inv).view(x.shape[0], Kp).to(torch.int8)
        d[n0:n0 + step] = dd.squeeze(2).half()
    return Q8Fields(u, d)


def q8_layout(f: Q8Fields) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical fields -> the kernel's q8_0 layout, (weight, scale): the weight as w8a8 interleaves it (q + 128, 16
    channels x 4 bytes), and per group the fp16 d of each block for the 16 channels side by side, ``[G, nb * 16]``
    (padding channels: d = 0)."""
    N, Kp = f.u.shape
    nb = Kp // ACT_BLOCK
    G = -(-N // W8A8_GROUP)
    weight = _interleave((f.u.to(torch.int16) + 128).to(torch.uint8))
    d = torch.zeros(G * W8A8_GROUP, nb, dtype=torch.float16, device=f.u.device)
    d[:N] = f.d
    return weight, d.view(G, W8A8_GROUP, nb).transpose(1, 2).contiguous().view(G, nb * W8A8_GROUP)


def _q8_rows(packed: PackedLinear, n0: int, n1: int) -> Q8Fields:
    """The fields of channels [n0, n1) of a q8_0 weight."""
    n1 = min(n1, packed.out_features)
    u = (_w8a8_rows(packed, n0, n1).to(torch.int16) - 128).to(torch.int8)
    G = packed.scale.shape[0]
    nb = packed.scale.shape[1] // W8A8_GROUP
    d = packed.scale.view(G, nb, W8A8_GROUP).transpose(1, 2).reshape(G * W8A8_GROUP, nb)[n0:n1]
    return Q8Fields(u, d)


def q8_weights(f: Q8Fields, K: int) -> torch.Tensor:
    """float32 ``[N, K]``: ``d * q`` (exact in float32: 11 by 8 significant bits), as gguf-py dequantizes Q8_0."""
    n, Kp = f.u.shape
    w = f.u.float().view(n, -1, ACT_BLOCK) * f.d.float()[:, :, None]
    return w.view(n, Kp)[:, :K]
