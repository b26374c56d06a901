"""w4a8: 4-bit weights in GGUF Q4_K's layout (``w = s * u - o`` per block of 32, codes in fp16 units per 256),
their logical fields, the search that quantizes float weights to them and the kernel's packed layout."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F

from specdecode.layers.kernels.formats import ACT_BLOCK, W4_SUPER, W8A8_GROUP, _round_up

if TYPE_CHECKING:
    from specdecode.layers.kernels.packed import PackedLinear

# value v maps to u = 0, i.e. -8 s = v for s = -v / c (c below); smaller c clip less often, larger c round finer.
# Affine: the block's range split into n steps from its minimum (u = 0), as GGUF's Q4_K stores a block. The
# candidate with the least squared error wins; its scale and offset are then rounded to the codes.
_W4_DIVISORS = (8.0, 7.75, 7.5, 7.25, 7.0, 6.75, 6.5, 6.0)
_W4_SPANS = (15, 14, 13, 12, 11, 10)
_W4_CODE_MAX = 127


class W4Fields(NamedTuple):
    """A w4a8 weight in logical form: ``w[n, k] = D[n, t] * cs[n, b] * u[n, k] - Dm[n, t] * co[n, b]`` with
    b = k // 32 and t = b // 8. ``u`` uint8 [N, Kp] (0..15), ``cs``/``co`` int8 [N, Kp / 32], ``D``/``Dm``
    float16 [N, ceil(Kp / 256)]."""
    u: torch.Tensor
    cs: torch.Tensor
    co: torch.Tensor
    D: torch.Tensor
    Dm: torch.Tensor


def cat_fields(parts: list) -> Any:
    """The channels of several weights with the same K (fields of one format: W4Fields, W6Fields), one after
    another."""
    return type(parts[0])(*(torch.cat(t) for t in zip(*parts)))


def _w4_scale_bytes(Kp: int) -> int:
    """Bytes of one 16-channel group's codes (32 a block) and fp16 units (64 per 8 blocks)."""
    nb = Kp // ACT_BLOCK
    return nb * 32 + -(-nb // W4_SUPER) * 64


def _w4_grids(blk: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The candidate grids (s, o), each float32 [B, 1], of each block of ``blk [B, 32]``."""
    v = blk.gather(1, blk.abs().argmax(dim=1, keepdim=True))  # signed extreme of each block
    lo, hi = blk.amin(dim=1, keepdim=True), blk.amax(dim=1, keepdim=True)
    return [(-v / c, -8.0 * v / c) for c in _W4_DIVISORS] + [((hi - lo) / n, -lo) for n in _W4_SPANS]


def _w4_best(blk: torch.Tensor, grids: list[tuple[torch.Tensor, torch.Tensor]]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s, o, u) of the grid with the least squared error for each block of ``blk [B, 32]``."""
    best_err = best_s = best_o = best_u = None
    for s, o in grids:
        u = _on_grid(blk, s, o)
        err = (u * s - o - blk).pow_(2).sum(dim=1, keepdim=True)
        if best_err is None:
            best_err, best_s, best_o, best_u = err, s, o, u
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, s, best_s)
            best_o = torch.where(better, o, best_o)
            best_u = torch.where(better, u, best_u)
    return best_s, best_o, best_u


def _on_grid(blk: torch.Tensor, s: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
    return torch.round((blk + o) * inv).clamp_(0, 15)


def _w4_units(v: torch.Tensor) -> torch.Tensor:
    """fp16 units [n, ceil(nb / 8)] for per-block values ``v [n, nb]``: the largest magnitude of each 8 blocks
    over the largest code, so that every value of those blocks has a code."""
    n, nb = v.shape
    ns = -(-nb // W4_SUPER)
    sup = F.pad(v, (0, ns * W4_SUPER - nb)).view(n, ns, W4_SUPER)
    return (sup.abs().amax(dim=2) / _W4_CODE_MAX).clamp_(max=65504.0).half()


def _w4_per_block(unit: torch.Tensor, nb: int, share: int = W4_SUPER) -> torch.Tensor:
    """float32 units ``[n, nb]``: each block's unit (``share`` blocks share one: 8 of w4a8's 32, 16 of w6a8's
    16)."""
    return unit.float().repeat_interleave(share, dim=1)[:, :nb]


def _w4_values(codes: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """float32 ``unit * code`` per block (exact: 8 and 11 significant bits), ``[n, nb]``."""
    return codes.float() * _w4_per_block(unit, codes.shape[1])


def _w4_code_of(v: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """The nearest int8 codes of per-block values ``v [n, nb]`` in their units."""
    uf = _w4_per_block(unit, v.shape[1])
    return torch.where(uf != 0, torch.round(v / torch.where(uf != 0, uf, torch.ones_like(uf))),
                       torch.zeros_like(v)).clamp_(-_W4_CODE_MAX, _W4_CODE_MAX).to(torch.int8)


def _w4_round(v: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """Per-block values ``v [n * nb, 1]`` rounded to their nearest codes' values."""
    return _w4_values(_w4_code_of(v.view(unit.shape[0], -1), unit), unit).view(-1, 1)


def _quantize_w4(w: torch.Tensor) -> W4Fields:
    """Float weights ``[N, K]`` -> w4a8 fields (K padded to a multiple of 32): per block the best candidate grid."""
    N, K = w.shape
    Kp = _round_up(K, ACT_BLOCK)
    nb = Kp // ACT_BLOCK
    parts: list[W4Fields] = []
    step = max(W8A8_GROUP, (1 << 20) // Kp)
    for n0 in range(0, N, step):
        x = F.pad(w[n0:n0 + step].float(), (0, Kp - K))
        n = x.shape[0]
        blk = x.view(n * nb, ACT_BLOCK)
        grids = _w4_grids(blk)
        s, o, _ = _w4_best(blk, grids)
        D, Dm = _w4_units(s.view(n, nb)), _w4_units(o.view(n, nb))  # from each block's best grid
        # Every candidate again, its scale and offset rounded to codes of those units, as the kernel will
        # multiply them: the best wins.
        s, o, u = _w4_best(blk, [(_w4_round(gs, D), _w4_round(go, Dm)) for gs, go in grids])
        cs, co = _w4_code_of(s.view(n, nb), D), _w4_code_of(o.view(n, nb), Dm)
        parts.append(W4Fields(u.view(n, Kp).to(torch.uint8), cs, co, D, Dm))
    return cat_fields(parts)


def q4k_fields(blocks: torch.Tensor, K: int) -> W4Fields:
    """A GGUF Q4_K tensor as stored (uint8 ``[N, K / 256 * 144]``, ``GGUFModel.raw_rows``) -> its w4a8 fields,
    which hold exactly the weights llama.cpp dequantizes: d and dmin become the units, the 6-bit scales and
    minimums the codes, the 4-bit values u."""
    from gguf.quants import Q4_K

    N = blocks.shape[0]
    nsb = K // 256
    b = blocks.reshape(N * nsb, 144).numpy()
    sc, mins = Q4_K.get_scale_min(b[:, 4:16])
    qs = torch.from_numpy(b[:, 16:].copy()).view(N * nsb, 4, 1, 32)
    u = (qs >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F  # [sb, chunk, nibble, 32]
    unit = lambda lo: torch.from_numpy(b[:, lo:lo + 2].copy()).view(torch.float16).view(N, nsb)  # noqa: E731
    codes = lambda c: torch.from_numpy(c.astype("int8")).view(N, nsb * 8)  # noqa: E731
    return W4Fields(u.reshape(N, K).contiguous(), codes(sc), codes(mins), unit(0), unit(2))


def w4_layout(f: W4Fields) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical fields -> the kernel's w4a8 layout, (weight, scale): per group of 16 channels and quarter of 8 K
    values, 64 bytes; lane l's byte i holds u of k0+i (low nibble) and of k0+4+i (high nibble)."""
    N, Kp = f.u.shape
    u = f.u.view(N, Kp // ACT_BLOCK, 4, 2, 4)  # [n, block, quarter, nibble, byte]
    return _w4_layout(u[:, :, :, 0] | (u[:, :, :, 1] << 4), f.cs, f.co, f.D, f.Dm)


def _w4_layout(byte: torch.Tensor, cs: torch.Tensor, co: torch.Tensor, D: torch.Tensor, Dm: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel's bytes ``[N, block, quarter, byte]`` (two of its nibbles per byte), codes and units -> the
    kernel's layout: channels padded to groups of 16 (weight 0) and interleaved per quarter; per group the
    codes of each block (cs of the 16 lanes, then co) and then the units of each 8 blocks (D, then Dm)."""
    N, nb = byte.shape[:2]
    G = -(-N // W8A8_GROUP)
    padded = torch.zeros((G * W8A8_GROUP, nb, 4, 4), dtype=torch.uint8, device=byte.device)
    padded[:N] = byte
    weight = padded.view(G, W8A8_GROUP, nb, 4, 4).permute(0, 2, 3, 1, 4).contiguous().view(G, nb * 256)

    def by_group(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # two [N, m] -> [G, m, 2, 16] as bytes
        out = torch.zeros(2, G * W8A8_GROUP, a.shape[1], dtype=a.dtype, device=byte.device)
        out[0, :N], out[1, :N] = a, b
        return out.view(2, G, W8A8_GROUP, -1).permute(1, 3, 0, 2).contiguous().view(G, -1).view(torch.uint8)

    return weight, torch.cat([by_group(cs, co), by_group(D, Dm)], dim=1)


def _w4_rows(packed: PackedLinear, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The bytes ``[n, block, quarter, byte]``, codes and units of just the channels ``rows`` (in that order),
    touching only their bytes: a draft head picks rows out of a 150k-row weight at run time."""
    rows = rows.to(packed.weight.device)
    G = packed.weight.shape[0]
    nb = packed.weight.shape[1] * 2 // W8A8_GROUP // ACT_BLOCK
    ns = -(-nb // W4_SUPER)
    g, lane = rows // W8A8_GROUP, rows % W8A8_GROUP
    byte = packed.weight.view(G, nb, 4, W8A8_GROUP, 4)[g, :, :, lane, :]
    codes = packed.scale[:, :nb * 32].view(torch.int8).view(G, nb, 2, W8A8_GROUP)[g, :, :, lane]  # [n, nb, 2]
    units = packed.scale[:, nb * 32:].contiguous().view(torch.float16).view(G, ns, 2, W8A8_GROUP)[g, :, :, lane]
    return byte, codes[:, :, 0], codes[:, :, 1], units[:, :, 0], units[:, :, 1]


def w4_weights(f: W4Fields, K: int) -> torch.Tensor:
    """float32 ``[N, K]``: the weights the kernel multiplies with, ``s * u - o`` (one rounding, as gguf-py's
    Q4_K dequantization)."""
    n = f.u.shape[0]
    w = f.u.float().view(n, -1, ACT_BLOCK) * _w4_values(f.cs, f.D)[:, :, None] - _w4_values(f.co, f.Dm)[:, :, None]
    return w.view(n, -1)[:, :K]


def _w4_unpack(packed: PackedLinear, n0: int = 0, n1: int | None = None) -> W4Fields:
    """The logical fields of channels [n0, n1) of a w4a8 weight."""
    n1 = packed.out_features if n1 is None else min(n1, packed.out_features)
    return _w4_unpack_rows(packed, torch.arange(n0, n1))


def _w4_unpack_rows(packed: PackedLinear, rows: torch.Tensor) -> W4Fields:
    """The logical fields of just the channels ``rows`` (in that order)."""
    byte, cs, co, D, Dm = _w4_rows(packed, rows)
    u = torch.stack([byte & 0x0F, byte >> 4], dim=3)  # [n, block, quarter, nibble, byte]
    return W4Fields(u.reshape(len(byte), -1), cs, co, D, Dm)

