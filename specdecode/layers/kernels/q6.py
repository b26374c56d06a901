"""w6a8: 6-bit weights in GGUF Q6_K's layout (``w = D * sc * (u - 32)``, an int8 code per 16 weights, an fp16
unit per 256), their logical fields, the quantization of float weights to them and the kernel's packed layout."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from specdecode.layers.kernels.formats import ACT_BLOCK, W4_SUPER, W6_BLOCK_BYTES, W8A8_GROUP, _round_up
from specdecode.layers.kernels.q4 import _W4_CODE_MAX, _w4_per_block, _w4_units, cat_fields

if TYPE_CHECKING:
    from specdecode.layers.kernels.packed import PackedLinear


class W6Fields(NamedTuple):
    """A w6a8 weight in logical form: ``w[n, k] = D[n, t] * sc[n, h] * (u[n, k] - 32)`` with h = k // 16 and
    t = k // 256. ``u`` uint8 [N, Kp] (0..63), ``sc`` int8 [N, Kp / 16], ``D`` float16 [N, ceil(Kp / 256)]."""
    u: torch.Tensor
    sc: torch.Tensor
    D: torch.Tensor


def _w6_scale_bytes(Kp: int) -> int:
    """Bytes of one 16-channel group's codes (32 a block) and fp16 units (32 per 8 blocks)."""
    nb = Kp // ACT_BLOCK
    return nb * 32 + -(-nb // W4_SUPER) * 32


def q6k_fields(blocks: torch.Tensor, K: int) -> W6Fields:
    """A GGUF Q6_K tensor as stored (uint8 ``[N, K / 256 * 210]``) -> its w6a8 fields, which hold exactly the
    weights llama.cpp dequantizes: d becomes the unit, the 16 int8 scales the codes, the 6-bit values u (the
    value order of gguf-py's Q6_K dequantization)."""
    if K % 256:
        raise ValueError(f"q6k_fields: a Q6_K row holds a multiple of 256 weights, got {K}")
    N, nsb = blocks.shape[0], K // 256
    b = blocks.reshape(N * nsb, 210)
    ql = (b[:, :128].reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F
    qh = (b[:, 128:192].reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    u = ql.reshape(-1, 256) | (qh.reshape(-1, 256) << 4)
    sc = b[:, 192:208].contiguous().view(torch.int8)
    D = b[:, 208:210].contiguous().view(torch.float16)
    return W6Fields(u.reshape(N, K).contiguous(), sc.reshape(N, nsb * 16), D.reshape(N, nsb))


def _quantize_w6(w: torch.Tensor) -> W6Fields:
    """Float weights -> w6a8 fields: per 16 weights the scale that maps the signed extreme to -32 (as a Q6_K block's
    largest value), as a code of the 256 weights' unit; u the nearest step, clamped to 0..63 (only a value of
    the other sign and nearly the extreme's size is clipped, to 31 steps)."""
    N, K = w.shape
    Kp = _round_up(K, ACT_BLOCK)
    parts: list[W6Fields] = []
    step = max(W8A8_GROUP, (1 << 20) // Kp)
    for n0 in range(0, N, step):
        x = F.pad(w[n0:n0 + step].float(), (0, Kp - K))
        n = x.shape[0]
        h = x.view(n, Kp // 16, 16)
        v = h.gather(2, h.abs().argmax(dim=2, keepdim=True)).squeeze(2)  # signed extreme of each 16
        s = -v / 32.0
        D = _w4_units(s.view(n, Kp // ACT_BLOCK, 2).abs().amax(dim=2))  # per 8 blocks, as w4a8's
        Dh = _w4_per_block(D, Kp // 16, 2 * W4_SUPER)
        # codes rounded away from zero, so that each 16's extreme stays on its grid (never clipped)
        r = s / torch.where(Dh != 0, Dh, torch.ones_like(Dh))
        sc = torch.where(Dh != 0, r.sign() * r.abs().ceil(), torch.zeros_like(s)).clamp_(-_W4_CODE_MAX, _W4_CODE_MAX)
        step_h = (Dh * sc)[:, :, None]
        u = torch.where(step_h != 0, torch.round(h / torch.where(step_h != 0, step_h, torch.ones_like(step_h))),
                        torch.zeros_like(h)).clamp_(-32, 31) + 32
        parts.append(W6Fields(u.view(n, Kp).to(torch.uint8), sc.to(torch.int8), D))
    return cat_fields(parts)


def w6_layout(f: W6Fields) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical fields -> the kernel's w6a8 layout (csrc/w6a8.cpp), (weight, scale): per group of 16 channels and
    block of 32 K values four 64-byte vectors of low nibbles (as w4a8's) and two of high bits, lane l's 4 bytes
    side by side; per group the codes of each block (lanes 0..15 of its first 16 K values, then of its second) and
    the fp16 units of each 8 blocks."""
    N, Kp = f.u.shape
    nb = Kp // ACT_BLOCK
    G = -(-N // W8A8_GROUP)
    u = f.u.view(N, nb, 4, 2, 4)  # [n, block, quarter, nibble, byte]
    low = (u[:, :, :, 0] & 0x0F) | ((u[:, :, :, 1] & 0x0F) << 4)
    hi = (f.u.view(N, nb, 2, 4, 4) >> 4)  # [n, block, half, quad, byte]
    high = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
    vecs = torch.zeros((G * W8A8_GROUP, nb, 6, 4), dtype=torch.uint8, device=f.u.device)
    vecs[:N, :, :4], vecs[:N, :, 4:] = low, high
    weight = vecs.view(G, W8A8_GROUP, nb, 6, 4).permute(0, 2, 3, 1, 4).contiguous().view(G, nb * W6_BLOCK_BYTES)

    def by_group(a: torch.Tensor, per: int) -> torch.Tensor:  # [N, m * per] -> [G, m, per, 16] as bytes
        out = torch.zeros(G * W8A8_GROUP, a.shape[1], dtype=a.dtype, device=f.u.device)
        out[:N] = a
        return out.view(G, W8A8_GROUP, -1, per).permute(0, 2, 3, 1).contiguous().view(G, -1).view(torch.uint8)

    return weight, torch.cat([by_group(f.sc, 2), by_group(f.D, 1)], dim=1)


def _w6_unpack_rows(packed: PackedLinear, rows: torch.Tensor) -> W6Fields:
    """The logical fields of just the channels ``rows`` (in that order) of a w6a8 weight."""
    rows = rows.to(packed.weight.device)
    G = packed.weight.shape[0]
    nb = packed.weight.shape[1] // W6_BLOCK_BYTES
    ns = -(-nb // W4_SUPER)
    g, lane = rows // W8A8_GROUP, rows % W8A8_GROUP
    vecs = packed.weight.view(G, nb, 6, W8A8_GROUP, 4)[g, :, :, lane, :]  # [n, block, vector, byte]
    n = len(rows)
    low = torch.stack([vecs[:, :, :4] & 0x0F, vecs[:, :, :4] >> 4], dim=3).reshape(n, nb, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=vecs.device).view(1, 1, 1, 4, 1)
    high = ((vecs[:, :, 4:, None, :] >> shifts) & 3).reshape(n, nb, 32)
    codes = packed.scale[:, :nb * 32].view(torch.int8).view(G, nb, 2, W8A8_GROUP)[g, :, :, lane]  # [n, nb, 2]
    units = packed.scale[:, nb * 32:].contiguous().view(torch.float16).view(G, ns, W8A8_GROUP)[g, :, lane]
    return W6Fields((low | (high << 4)).reshape(n, nb * 32), codes.reshape(n, nb * 2), units)


def w6_weights(f: W6Fields, K: int) -> torch.Tensor:
    """float32 ``[N, K]``: ``(D * sc) * (u - 32)`` in float32, as gguf-py's Q6_K dequantization rounds it (the
    kernel takes the integer sums exactly, so its products may differ from these in the last bit)."""
    n = f.u.shape[0]
    Dh = _w4_per_block(f.D, f.sc.shape[1], 2 * W4_SUPER)
    w = (Dh * f.sc.float())[:, :, None] * (f.u.float().view(n, -1, 16) - 32.0)
    return w.view(n, -1)[:, :K]

