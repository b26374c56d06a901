"""int8 and w8a8: symmetric per-channel int8 weights, w8a8's interleaved layout and the activations the integer
formats (w8a8, w4a8, w6a8) quantize per row."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdecode.layers.kernels.formats import ACT_BLOCK, W8A8_GROUP, _round_up

if TYPE_CHECKING:
    from specdecode.layers.kernels.packed import PackedLinear


def quantize_int8(w: torch.Tensor, Kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 ``[N, Kp]`` zero padded, scale float32 ``[N]``) of a ``[N, K]`` weight: symmetric, per output
    channel; processed in row chunks to bound temporary memory."""
    N, K = w.shape
    q = torch.zeros(N, Kp, dtype=torch.int8, device=w.device)
    scale = torch.empty(N, dtype=torch.float32, device=w.device)
    step = max(1, (1 << 22) // max(K, 1))
    for n0 in range(0, N, step):
        blk = w[n0:n0 + step].float()
        s = blk.abs().amax(dim=1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))  # all-zero rows: q = 0, any scale works
        q[n0:n0 + step, :K] = torch.round(blk / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[n0:n0 + step] = s
    return q, scale


def _interleave(w: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, Kp]`` -> ``[ceil(N / 16), Kp * 16]``: for each group of 16 channels, K in quads of 4 bytes,
    each quad's 64 bytes holding the 16 channels' 4 bytes side by side (padding channels are 128 = 0)."""
    N, Kp = w.shape
    G = -(-N // W8A8_GROUP)
    full = torch.full((G * W8A8_GROUP, Kp), 128, dtype=torch.uint8, device=w.device)
    full[:N] = w
    return full.view(G, W8A8_GROUP, Kp // 4, 4).permute(0, 2, 1, 3).contiguous().view(G, Kp * W8A8_GROUP)


def _w8a8_rows(packed: PackedLinear, n0: int, n1: int) -> torch.Tensor:
    """Logical uint8 rows ``[n0, n1)`` (``[n1 - n0, Kp]``, values q + 128) of an interleaved w8a8 weight."""
    g0, g1 = n0 // W8A8_GROUP, -(-n1 // W8A8_GROUP)
    Kp = packed.weight.shape[1] // W8A8_GROUP
    groups = packed.weight[g0:g1].view(g1 - g0, Kp // 4, W8A8_GROUP, 4).permute(0, 2, 1, 3)
    rows = groups.reshape((g1 - g0) * W8A8_GROUP, Kp)
    return rows[n0 - g0 * W8A8_GROUP:n1 - g0 * W8A8_GROUP]


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the w8a8 kernel multiplies with: each row of ``x [M, K]`` quantized in blocks of
    ``ACT_BLOCK`` along K (``d = absmax / 127``, ``q = round(x * (1 / d))``), returned dequantized
    (``q * d``, float32). Row i depends on row i only."""
    M, K = x.shape
    Kp = _round_up(K, ACT_BLOCK)
    xp = F.pad(x.float(), (0, Kp - K)).reshape(M, Kp // ACT_BLOCK, ACT_BLOCK)
    d = xp.abs().amax(dim=2, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xp * inv).clamp_(-127, 127)
    return (q * d).reshape(M, Kp)[:, :K]

