"""Row-invariant CPU linear kernel: build/load and Python API.

``rowinv_linear(x, packed)`` computes ``x @ W.T (+ bias)`` such that output row i is bitwise identical
whatever M is, whatever the other rows contain and whatever ``torch.get_num_threads()`` is: every
(row, output channel) dot product is reduced over K in one fixed order, and threads split only the
output channels. A forward over M <= 64 rows reads each weight once, so verifying k draft tokens
costs little more than decoding one.

The C++ source (``cpu_linear.cpp``, shipped as package data) is JIT-built with
``torch.utils.cpp_extension.load`` on first use and cached in the torch extensions directory, or in
``$SPECDECODE_KERNEL_DIR`` if set; later loads import the built module directly. If the build fails, one
warning is logged and a slow but still row-invariant pure-torch path is used. ``SPECDECODE_DISABLE_KERNEL=1``
(read at call time) or ``kernels.FORCE_FALLBACK = True`` forces that path.

Weight formats (``pack_linear``):
  * ``fp32``: float32 weight.
  * ``bf16``: bfloat16 weight (round-to-nearest-even from wider types), widened to fp32 in-register.
  * ``int8``: symmetric per-output-channel quantization, ``scale = absmax / 127``,
    ``q = round(w / scale)``; the kernel computes ``(x . q) * scale`` with fp32 activations.
  * ``w8a8``: the same int8 weights (stored as ``q + 128`` in uint8, K padded to a multiple of 32, and
    interleaved in groups of 16 channels x 4 bytes for the integer dot-product instructions: ``_interleave``),
    multiplied by activations that the kernel quantizes per row in blocks of 32 (``quantize_activations``),
    with exact integer dot products (AVX-512 VNNI or AVX2). Integer sums have no order, so row
    invariance is free, and a pass over several rows costs little more than over one.
  * ``w4a8``: 4-bit weights in GGUF Q4_K's layout: ``w = s * u - o`` with u in 0..15 and, per block of 32
    weights of a channel, ``s = D * cs`` and ``o = Dm * co`` (int8 codes ``cs``, ``co``; fp16 units ``D``, ``Dm``
    shared by 8 blocks), 18.5 bytes per 32 weights, with the same quantized activations and integer dot
    products. A Q4_K tensor is taken as stored (``pack_q4k``: its d, dmin, 6-bit scales and minimums), so a
    Q4_K_M checkpoint keeps its exact weights at about half the bytes of w8a8; other weights get per block the
    best of a few symmetric and affine grids (``_quantize_w4``).
  * ``w6a8``: 6-bit weights in GGUF Q6_K's layout: ``w = D * sc * (u - 32)`` with u in 0..63, an int8 code ``sc``
    per 16 weights and an fp16 unit ``D`` per 256 (6.5625 bits a weight), with the same quantized activations
    and exact integer sums. A Q6_K tensor is taken as stored (``pack_q6k``); other weights get per 16 the
    scale that puts their extreme on the grid (``_quantize_w6``).
For fp32/bf16/int8, activations and accumulation are fp32.

Non-CPU inputs (e.g. CUDA) use ``F.linear`` on a dequantized weight cached on that device; bitwise row
invariance is NOT guaranteed there.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import warnings
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FORMATS = ("fp32", "bf16", "int8", "w8a8", "w4a8", "w6a8")
_FMT_CODE = {"fp32": 0, "bf16": 1, "int8": 2, "w8a8": 3, "w4a8": 4, "w6a8": 5}
_WEIGHT_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "w8a8": torch.uint8,
                 "w4a8": torch.uint8, "w6a8": torch.uint8}
_K_ALIGN = {"fp32": 8, "bf16": 8, "int8": 8, "w8a8": 32, "w4a8": 32, "w6a8": 32}
QUANTIZED = ("int8", "w8a8", "w4a8", "w6a8")  # formats that replace the float weight (Linear.prepare)
INT_ACTS = ("w8a8", "w4a8", "w6a8")  # formats whose kernel also quantizes the activations (quantize_activations)
W8A8_GROUP = 16  # channels per interleaved w8a8 weight group
ACT_BLOCK = 32  # w8a8 activation quantization block (along K)
W4_SUPER = 8  # w4a8 blocks of 32 that share one fp16 scale unit and one offset unit (Q4_K's 256 weights)
W6_BLOCK_BYTES = 384  # bytes of one w6a8 group's block of 32 K values: 4 vectors of low nibbles, 2 of high bits
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_linear.cpp")

# Set to True to force the pure-torch fallback (tests / debugging).
FORCE_FALLBACK = False

_lock = threading.Lock()
_ext: Any = None
_build_failed = False


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


# ------------------------------------------------------------------------------------------------
# Packed weights
# ------------------------------------------------------------------------------------------------
class PackedLinear:
    """A weight prepared for the kernel.

    ``weight`` is ``[N, Kp]`` (Kp = K rounded up to a multiple of 8, zero padded) of dtype float32,
    bfloat16 or int8 depending on ``fmt``; for w8a8 it is uint8 ``[ceil(N / 16), Kp * 16]`` in the
    interleaved layout (``_interleave``), for w4a8 uint8 ``[ceil(N / 16), Kp * 8]`` (``_w4_layout``). ``scale`` is
    float32 ``[N]`` for int8 and w8a8; for w4a8 uint8 ``[ceil(N / 16), _w4_scale_bytes(Kp)]``, each group's
    block codes and then its fp16 units (``_w4_layout``); else None.
    A plain object (not an nn.Module) so that it never shows up in a model's state_dict.
    """

    __slots__ = ("fmt", "out_features", "in_features", "weight", "scale", "_dense_cache", "_checked")

    def __init__(self, fmt: str, weight: torch.Tensor, scale: torch.Tensor | None, in_features: int,
                 out_features: int | None = None):
        self.fmt = fmt
        self.weight = weight
        self.scale = scale
        self.out_features = int(weight.shape[0] if out_features is None else out_features)
        self.in_features = int(in_features)
        self._dense_cache: dict[torch.device, torch.Tensor] = {}
        self._checked: tuple = ()

    def _kernel_args(self) -> tuple[int, int, int, torch.Tensor | None]:
        """(weight pointer, row stride, format code, float32 CPU scale) after checking the layout the
        C++ kernel relies on; the check is redone whenever the weight/scale tensors change."""
        w, scale = self.weight, self.scale
        # Cheap key: a new tensor object or new storage triggers a full re-check.
        key = (id(w), w.data_ptr(), id(scale), None if scale is None else scale.data_ptr())
        if self._checked and self._checked[0] == key:
            return self._checked[1]
        N, K = self.out_features, self.in_features
        if self.fmt == "w8a8":
            Kp = w.shape[1] // W8A8_GROUP if w.ndim == 2 else 0
            if (w.dtype != torch.uint8 or w.ndim != 2 or not w.is_contiguous() or not w.is_cpu
                    or w.shape[0] != -(-N // W8A8_GROUP) or Kp < K or Kp % _K_ALIGN["w8a8"]
                    or w.shape[1] != Kp * W8A8_GROUP):
                raise ValueError(f"w8a8_linear: malformed interleaved weight {tuple(w.shape)} {w.dtype} for {self!r}")
            stride = Kp
        elif self.fmt == "w4a8":
            G = -(-N // W8A8_GROUP)
            Kp = w.shape[1] // (W8A8_GROUP // 2) if w.ndim == 2 else 0
            if (w.dtype != torch.uint8 or w.ndim != 2 or not w.is_contiguous() or not w.is_cpu or w.shape[0] != G
                    or Kp < K or Kp % ACT_BLOCK or w.shape[1] != Kp * W8A8_GROUP // 2 or scale is None
                    or scale.dtype != torch.uint8 or not scale.is_contiguous() or not scale.is_cpu
                    or tuple(scale.shape) != (G, _w4_scale_bytes(Kp))):
                raise ValueError(f"w4a8_linear: malformed packed weight {tuple(w.shape)} {w.dtype} for {self!r}")
            stride = Kp
        elif self.fmt == "w6a8":
            G = -(-N // W8A8_GROUP)
            Kp = w.shape[1] * ACT_BLOCK // W6_BLOCK_BYTES if w.ndim == 2 else 0
            if (w.dtype != torch.uint8 or w.ndim != 2 or not w.is_contiguous() or not w.is_cpu or w.shape[0] != G
                    or Kp < K or Kp % ACT_BLOCK or w.shape[1] != Kp // ACT_BLOCK * W6_BLOCK_BYTES or scale is None
                    or scale.dtype != torch.uint8 or not scale.is_contiguous() or not scale.is_cpu
                    or tuple(scale.shape) != (G, _w6_scale_bytes(Kp))):
                raise ValueError(f"w6a8_linear: malformed packed weight {tuple(w.shape)} {w.dtype} for {self!r}")
            stride = Kp
        elif (w.dtype != _WEIGHT_DTYPE[self.fmt] or w.ndim != 2 or w.shape[0] != N or w.stride(1) != 1
                or w.shape[1] < _round_up(K, _K_ALIGN[self.fmt]) or (N > 1 and w.stride(0) < w.shape[1]) or not w.is_cpu):
            raise ValueError(f"rowinv_linear: malformed packed weight {tuple(w.shape)} {w.dtype} for {self!r}")
        else:
            stride = w.stride(0)
        if self.fmt in ("int8", "w8a8"):
            if scale is None or tuple(scale.shape) != (N,):
                raise ValueError("rowinv_linear: int8 weight needs a [N] scale")
            if scale.dtype != torch.float32 or not scale.is_cpu or not scale.is_contiguous():
                scale = scale.to(device="cpu", dtype=torch.float32).contiguous()
        elif self.fmt not in ("w4a8", "w6a8"):  # their codes and units were checked above
            scale = None
        args = (w.data_ptr(), stride, _FMT_CODE[self.fmt], scale)
        self._checked = (key, args)
        return args

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def select_rows(self, rows: torch.Tensor) -> "PackedLinear":
        """The same format restricted to output channels ``rows`` (copied)."""
        if self.fmt == "w4a8":
            return _w4_select_rows(self, rows)
        if self.fmt == "w6a8":
            return pack_w6(_w6_unpack_rows(self, rows), self.in_features)
        scale = self.scale[rows].contiguous() if self.scale is not None else None
        if self.fmt == "w8a8":
            return PackedLinear(self.fmt, _interleave(_w8a8_rows(self, 0, self.out_features)[rows]), scale,
                                self.in_features, len(rows))
        return PackedLinear(self.fmt, self.weight[rows].contiguous(), scale, self.in_features)

    @property
    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        if self.scale is not None:
            n += self.scale.numel() * self.scale.element_size()
        return n

    def __repr__(self) -> str:
        return (f"PackedLinear(fmt={self.fmt!r}, out_features={self.out_features}, "
                f"in_features={self.in_features}, device={self.device})")


def pack_linear(weight: torch.Tensor, fmt: str) -> PackedLinear:
    """Prepare a ``[N, K]`` weight (any float dtype) for ``rowinv_linear``.

    fp32 weights that are already contiguous float32 with K % 8 == 0 are shared, not copied.
    """
    if fmt not in FORMATS:
        raise ValueError(f"Unknown weight format {fmt!r}; valid formats are: {', '.join(FORMATS)}")
    if weight.dim() != 2:
        raise ValueError(f"pack_linear expects a 2-D [out_features, in_features] weight, got shape "
                         f"{tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"pack_linear expects a floating-point weight, got {weight.dtype}")
    w = weight.detach()
    N, K = w.shape
    Kp = _round_up(K, _K_ALIGN[fmt])

    if fmt == "fp32":
        if w.dtype == torch.float32 and w.is_contiguous() and Kp == K:
            return PackedLinear(fmt, w, None, K)
        out = torch.zeros(N, Kp, dtype=torch.float32, device=w.device)
        out[:, :K] = w
        return PackedLinear(fmt, out, None, K)

    if fmt == "bf16":
        if w.dtype == torch.bfloat16 and w.is_contiguous() and Kp == K:
            return PackedLinear(fmt, w, None, K)
        out = torch.zeros(N, Kp, dtype=torch.bfloat16, device=w.device)
        out[:, :K] = w  # round-to-nearest-even
        return PackedLinear(fmt, out, None, K)

    if fmt == "w4a8":
        return _quantize_w4(w)
    if fmt == "w6a8":
        return _quantize_w6(w)

    # int8: symmetric, per output channel; processed in row chunks to bound temporary memory.
    q = torch.zeros(N, Kp, dtype=torch.int8, device=w.device)
    scale = torch.empty(N, dtype=torch.float32, device=w.device)
    step = max(1, (1 << 22) // max(K, 1))
    for n0 in range(0, N, step):
        blk = w[n0:n0 + step].float()
        s = blk.abs().amax(dim=1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))  # all-zero rows: q = 0, any scale works
        q[n0:n0 + step, :K] = torch.round(blk / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[n0:n0 + step] = s
    if fmt == "w8a8":  # unsigned storage for vpdpbusd; padding becomes 128, i.e. weight 0
        return PackedLinear(fmt, _interleave((q.to(torch.int16) + 128).to(torch.uint8)), scale, K, N)
    return PackedLinear(fmt, q, scale, K)


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


# Candidate grids per block of 32 (w = s * u - o, u in 0..15). Symmetric (o = 8 s): the block's largest-magnitude
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


def _quantize_w4(w: torch.Tensor) -> PackedLinear:
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
    return pack_w4(cat_fields(parts), K)


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


def pack_q4k(blocks: torch.Tensor, K: int) -> PackedLinear:
    """``pack_linear(dequantized Q4_K weight, "w4a8")`` without the search: the Q4_K blocks as stored."""
    if K % 256:
        raise ValueError(f"pack_q4k: a Q4_K row holds a multiple of 256 weights, got {K}")
    return pack_w4(q4k_fields(blocks, K), K)


def pack_w4(f: W4Fields, K: int) -> PackedLinear:
    """Logical fields -> the kernel's w4a8 layout: per group of 16 channels and quarter of 8 K values, 64 bytes;
    lane l's byte i holds u of k0+i (low nibble) and of k0+4+i (high nibble)."""
    N, Kp = f.u.shape
    u = f.u.view(N, Kp // ACT_BLOCK, 4, 2, 4)  # [n, block, quarter, nibble, byte]
    return _w4_layout(u[:, :, :, 0] | (u[:, :, :, 1] << 4), f.cs, f.co, f.D, f.Dm, K)


def _w4_layout(byte: torch.Tensor, cs: torch.Tensor, co: torch.Tensor, D: torch.Tensor, Dm: torch.Tensor,
               K: int) -> PackedLinear:
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

    scale = torch.cat([by_group(cs, co), by_group(D, Dm)], dim=1)
    return PackedLinear("w4a8", weight, scale, K, N)


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


def _w4_select_rows(packed: PackedLinear, rows: torch.Tensor) -> PackedLinear:
    """``packed`` restricted to channels ``rows``: their bytes are moved whole (a byte holds two nibbles of one
    channel), so a 150k-row draft head is cut without unpacking it."""
    return _w4_layout(*_w4_rows(packed, rows), packed.in_features)


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


def pack_q6k(blocks: torch.Tensor, K: int) -> PackedLinear:
    """A GGUF Q6_K tensor as stored -> w6a8 holding exactly its weights."""
    return pack_w6(q6k_fields(blocks, K), K)


def _quantize_w6(w: torch.Tensor) -> PackedLinear:
    """Float weights -> w6a8: per 16 weights the scale that maps the signed extreme to -32 (as a Q6_K block's
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
    return pack_w6(cat_fields(parts), K)


def pack_w6(f: W6Fields, K: int) -> PackedLinear:
    """Logical fields -> the kernel's w6a8 layout (cpu_linear.cpp, W6A8): per group of 16 channels and block of
    32 K values four 64-byte vectors of low nibbles (as w4a8's) and two of high bits, lane l's 4 bytes side by
    side; per group the codes of each block (lanes 0..15 of its first 16 K values, then of its second) and the
    fp16 units of each 8 blocks."""
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

    scale = torch.cat([by_group(f.sc, 2), by_group(f.D, 1)], dim=1)
    return PackedLinear("w6a8", weight, scale, K, N)


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


def dequantize(packed: PackedLinear) -> torch.Tensor:
    """float32 ``[N, K]`` weight equal to what the kernel multiplies with (int8: ``q * scale``)."""
    return _dequantize_rows(packed, 0, packed.out_features).contiguous()


def _dequantize_rows(packed: PackedLinear, n0: int, n1: int) -> torch.Tensor:
    """float32 weight rows [n0, n1) (a view for fp32, a new tensor otherwise)."""
    if packed.fmt == "w4a8":
        return w4_weights(_w4_unpack(packed, n0, n1), packed.in_features)
    if packed.fmt == "w6a8":
        rows = torch.arange(n0, min(n1, packed.out_features))
        return w6_weights(_w6_unpack_rows(packed, rows), packed.in_features)
    if packed.fmt == "w8a8":
        n1 = min(n1, packed.out_features)
        w = _w8a8_rows(packed, n0, n1)[:, :packed.in_features].to(torch.int16) - 128
    else:
        w = packed.weight[n0:n1, :packed.in_features]
    return w.float() * packed.scale[n0:n1, None] if packed.scale is not None else w.float()


# ------------------------------------------------------------------------------------------------
# Build / load
# ------------------------------------------------------------------------------------------------
def _cpu_tag() -> str:
    """Short hash of the CPU flags, so a -march=native build is never reused on another CPU."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    import platform
    return hashlib.sha1((platform.machine() + flags).encode()).hexdigest()[:10]


# -fopenmp: at::parallel_for is header-only and only runs in parallel when compiled with OpenMP; the libgomp.so.1
# torch already loaded is reused (same soname), so there is a single runtime. The second try is the portable
# scalar path.
_BASE_CFLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]
_BUILD_ATTEMPTS = (_BASE_CFLAGS + ["-march=native"], _BASE_CFLAGS)


def _build_root() -> str:
    """``$SPECDECODE_KERNEL_DIR``, else torch's extensions directory (``$TORCH_EXTENSIONS_DIR`` or
    ``torch_extensions`` in the user cache). Not the model cache: tests and users point that elsewhere
    freely, and each new place would mean a fresh compile."""
    env = os.environ.get("SPECDECODE_KERNEL_DIR") or os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "torch_extensions")


def _build_name(cflags: list[str]) -> str:
    """The module name of one build: it changes with the source, the flags, torch and the CPU, so an existing
    build of that name is current and can be imported without asking the build system."""
    h = hashlib.sha1()
    for part in (_cpu_tag(), torch.__version__, " ".join(cflags)):
        h.update(part.encode() + b"\0")
    with open(_SOURCE, "rb") as f:
        h.update(f.read())
    return f"specdecode_cpu_linear_{h.hexdigest()[:12]}"


def _import_built(name: str, directory: str) -> Any:
    """The already built module ``name``, or None. Importing it directly skips cpp_extension (and the
    setuptools import it brings), which is most of a warm load."""
    import importlib.util

    path = os.path.join(directory, name + ".so")
    if not os.path.isfile(path):
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:  # a build another process is still linking, or a damaged file: let the builder decide
        return None


def _load_extension() -> Any:
    root = _build_root()
    builds = [(_build_name(cflags), cflags) for cflags in _BUILD_ATTEMPTS]
    for name, _ in builds:  # an earlier build of either (where the native one failed, the portable one)
        module = _import_built(name, os.path.join(root, name))
        if module is not None:
            return module
    last_err: Exception | None = None
    for name, cflags in builds:
        directory = os.path.join(root, name)
        try:
            from torch.utils import cpp_extension

            os.makedirs(directory, exist_ok=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return cpp_extension.load(name=name, sources=[_SOURCE], extra_cflags=cflags,
                                          extra_ldflags=["-fopenmp"], build_directory=directory, verbose=False)
        except Exception as e:  # compiler missing, ninja missing, bad flags, unwritable directory, ...
            last_err = e
    assert last_err is not None
    raise last_err


def _get_ext() -> Any:
    global _ext, _build_failed
    if _ext is not None or _build_failed:
        return _ext
    with _lock:
        if _ext is None and not _build_failed:
            try:
                _ext = _load_extension()
            except Exception as e:
                _build_failed = True
                logger.warning("specdecode: could not build the row-invariant CPU linear kernel (%s: %s); "
                               "using a slow pure-torch fallback.", type(e).__name__, str(e).strip()[:500])
    return _ext


_ENV_NAME = "SPECDECODE_DISABLE_KERNEL"
try:  # os.environ's backing dict: same data as os.environ.get, ~20x cheaper per call
    _ENV_DATA, _ENV_KEY = os.environ._data, os.environ.encodekey(_ENV_NAME)  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover
    _ENV_DATA, _ENV_KEY = None, _ENV_NAME


def _env_disabled() -> bool:
    if _ENV_DATA is not None:
        v = _ENV_DATA.get(_ENV_KEY)
        if v is None:
            return False
        v = v.decode(errors="replace") if isinstance(v, bytes) else str(v)
    else:  # pragma: no cover
        v = os.environ.get(_ENV_NAME)
        if v is None:
            return False
    return v.strip().lower() not in ("", "0", "false", "no", "off")


def _disabled() -> bool:
    """Fallback forced by ``FORCE_FALLBACK`` or ``SPECDECODE_DISABLE_KERNEL`` (read at every call)."""
    return FORCE_FALLBACK or _env_disabled()


def kernel_available() -> bool:
    """True if the compiled kernel is usable (builds it on first call)."""
    if _disabled():
        return False
    return _get_ext() is not None


def kernel_info() -> dict:
    ext = None if _disabled() else _get_ext()
    return {"available": ext is not None, "avx2": bool(ext.has_avx2()) if ext is not None else False,
            "isa": ext.isa() if ext is not None else None, "amx": amx_active(), "disabled": _disabled()}


@functools.cache
def source_digest() -> str:
    """A short digest of the kernel's C++ source: pass costs timed with one build say little about another."""
    with open(_SOURCE, "rb") as f:
        return hashlib.sha1(f.read()).hexdigest()[:12]


def describe() -> str:
    """One line for reports: which CPU path decode and verification rows run on."""
    info = kernel_info()
    if not info["available"]:
        return "torch fallback (row-invariant kernel " + ("disabled)" if info["disabled"] else "unavailable)")
    return info["isa"] + (", AMX tiles for multi-row w8a8 / w4a8 calls" if info["amx"] else "")


def top_probability(row: torch.Tensor) -> float | None:
    """max(softmax(row)) of a contiguous float32 CPU row by the extension (-1.0 where the row is not finite), or
    None without the extension."""
    ext = None if _disabled() else _get_ext()
    fn = getattr(ext, "top_probability", None)  # absent from builds of older sources (benchmarks/bench_kernel_ab.py)
    if fn is None or row.numel() == 0:
        return None
    return float(fn(row.data_ptr(), row.numel()))


def words_sums(base: int, fd: int, items: list[tuple[int, int, bool]]) -> list[int | None] | None:
    """The packed cache's checksums (models/packed_cache.py) of ``items`` (offset, bytes, read from ``fd``
    instead of the mapping at ``base``) in one call that releases the GIL, or None without the extension."""
    ext = None if _disabled() else _get_ext()
    fn = getattr(ext, "words_sums", None)
    return fn(base, fd, items) if fn is not None else None


def set_amx(enabled: bool) -> bool:
    """Let multi-row integer calls (w8a8 from 3 rows, w4a8 from 7) use AMX tiles; on by default where the CPU
    has them and the OS grants them, ``SPECDECODE_AMX=0`` keeps them off. The results are bitwise the same
    either way, so this only changes speed. Returns whether AMX is now in use."""
    ext = None if _disabled() else _get_ext()
    return bool(ext.amx(int(bool(enabled)))) if ext is not None else False


def amx_active() -> bool:
    """Whether multi-row integer calls currently run on AMX tiles (see set_amx)."""
    ext = None if _disabled() else _get_ext()
    return bool(ext.amx()) if ext is not None else False


# ------------------------------------------------------------------------------------------------
# Compute
# ------------------------------------------------------------------------------------------------
def _dense_on(packed: PackedLinear, device: torch.device) -> torch.Tensor:
    w = packed._dense_cache.get(device)
    if w is None:
        w = dequantize(packed).to(device)
        packed._dense_cache[device] = w
    return w


def _weight_chunks(packed: PackedLinear, device: torch.device):
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


def rowinv_linear(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] float32 -> [M, N] float32``, row i bitwise independent of M, other rows and threads."""
    if x.ndim != 2 or x.shape[1] != packed.in_features:
        raise ValueError(f"rowinv_linear: expected x of shape [M, {packed.in_features}], got {tuple(x.shape)}")
    if x.dtype is not torch.float32:
        x = x.float()
    if not x.is_cpu:
        # Accelerators: plain BLAS on a cached dequantized copy. Row invariance is NOT guaranteed.
        w = _dense_on(packed, x.device)
        b = bias.to(device=x.device, dtype=torch.float32) if bias is not None else None
        return F.linear(quantize_activations(x) if packed.fmt in INT_ACTS else x, w, b)
    if not x.is_contiguous():
        x = x.contiguous()
    if _disabled() or not packed.weight.is_cpu:
        return _fallback(x, packed, bias)
    ext = _ext if _ext is not None else _get_ext()
    if ext is None:
        return _fallback(x, packed, bias)

    # The extension takes raw pointers: every layout assumption is checked here.
    N = packed.out_features
    wptr, ldw, code, scale = packed._kernel_args()
    if bias is not None:
        if not (bias.dtype is torch.float32 and bias.is_cpu and bias.is_contiguous()):
            bias = bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if bias.numel() != N:
            raise ValueError(f"rowinv_linear: bias has {bias.numel()} elements, expected {N}")
    M, K = x.shape
    y = torch.empty(M, N, dtype=torch.float32)
    ext.linear(code, x.data_ptr(), K, wptr, ldw, K, scale.data_ptr() if scale is not None else 0,
               bias.data_ptr() if bias is not None else 0, y.data_ptr(), N, M, N)
    return y


# ------------------------------------------------------------------------------------------------
# Decoder layers in one call (decode / verification rows)
# ------------------------------------------------------------------------------------------------
_LAYER_FIELDS = 6 + 4 * 7  # cpu_linear.cpp: kLayerFields
KEY_TILE = 16  # cpu_linear.cpp: kKeyTile, the positions per KV cache block (engine.kv_cache.BLOCK_SIZE)
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # cpu_linear.cpp: KvFmt


# rowinv_linear as an opaque op, so that torch.compile keeps it in the graph (a plain C extension call
# would break the graph at every linear) and fuses only what lies between the linears. It takes the packed
# weight's tensors, not the PackedLinear: graph inputs, so every layer shares one graph.
@torch.library.custom_op("specdecode::rowinv_linear", mutates_args=())
def rowinv_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                     fmt: str, out_features: int) -> torch.Tensor:
    return rowinv_linear(x, PackedLinear(fmt, weight, scale, x.shape[1], out_features), bias)


@rowinv_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, fmt: str,
      out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)


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
    (engine.kv_cache.KVCache.layer) in float32, float16 or bfloat16, and ``qkv`` / ``o`` / ``gate_up`` / ``down``
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
            raise ValueError(f"LayerStack: KV cache dtype {kv_dtype} is not one of float32, float16, bfloat16")
        num_blocks = layers[0]["keys"].shape[0] if layers else 1
        rows = []
        for L in layers:
            keys, values = L["keys"], L["values"]
            want = {"keys": (num_blocks, kv_heads, head_dim, KEY_TILE), "values": (num_blocks, kv_heads, KEY_TILE, head_dim)}
            for name, t in (("keys", keys), ("values", values)):
                if (tuple(t.shape) != want[name] or t.dtype is not kv_dtype or not t.is_cpu
                        or not t.is_contiguous()):
                    raise ValueError(f"LayerStack: {name} must be a contiguous {kv_dtype} CPU tensor {list(want[name])}")
            row = [_ptr(_f32(L["attn_norm"], "attn_norm")), _ptr(_f32(L["mlp_norm"], "mlp_norm")),
                   *(0 if L[n] is None else _ptr(_f32(L[n], n)) for n in ("q_norm", "k_norm")),
                   _ptr(keys), _ptr(values)]
            keep += [L[k] for k in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "keys", "values")]
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
