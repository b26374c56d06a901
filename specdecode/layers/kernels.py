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
  * ``w4a8``: 4-bit weights, one fp16 scale and one fp16 offset per 32 weights of a channel
    (``w = s * q - o``, q in -8..7; per block the best of a few symmetric (o = 0) and affine grids), with the
    same quantized activations and integer dot products. An affine grid holds a GGUF Q4_K block as it is
    stored (up to fp16 rounding of its scale and minimum), so a Q4_K_M checkpoint keeps its quality at about
    half the bytes of w8a8; a format without any offset skips their epilogue.
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
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FORMATS = ("fp32", "bf16", "int8", "w8a8", "w4a8")
_FMT_CODE = {"fp32": 0, "bf16": 1, "int8": 2, "w8a8": 3, "w4a8": 4}
_W4_OFFSETS_CODE = 5  # cpu_linear.cpp's kW4A8O: w4a8 whose scale tensor also holds block offsets
_WEIGHT_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "w8a8": torch.uint8,
                 "w4a8": torch.uint8}
_K_ALIGN = {"fp32": 8, "bf16": 8, "int8": 8, "w8a8": 32, "w4a8": 32}
QUANTIZED = ("int8", "w8a8", "w4a8")  # formats that replace the float weight (quantization= values)
INT_ACTS = ("w8a8", "w4a8")  # formats whose kernel also quantizes the activations (quantize_activations)
W8A8_GROUP = 16  # channels per interleaved w8a8 weight group
ACT_BLOCK = 32  # w8a8 activation quantization block (along K)
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
    interleaved layout (``_interleave``), for w4a8 uint8 ``[ceil(N / 16), Kp * 8]`` (``_w4_pack``). ``scale`` is
    float32 ``[N]`` for int8 and w8a8; for w4a8 float16 ``[ceil(N / 16), Kp / 32 * 16]`` block scales, or
    ``[2, ceil(N / 16), Kp / 32 * 16]`` block scales then block offsets; else None.
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
                    or scale.dtype != torch.float16 or not scale.is_contiguous() or not scale.is_cpu
                    or tuple(scale.shape)[-2:] != (G, Kp // ACT_BLOCK * W8A8_GROUP)
                    or scale.shape[:-2] not in ((), (2,))):
                raise ValueError(f"w4a8_linear: malformed packed weight {tuple(w.shape)} {w.dtype} for {self!r}")
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
        elif self.fmt != "w4a8":  # w4a8's fp16 block scales were checked above
            scale = None
        code = _W4_OFFSETS_CODE if self.fmt == "w4a8" and scale.ndim == 3 else _FMT_CODE[self.fmt]
        args = (w.data_ptr(), stride, code, scale)
        self._checked = (key, args)
        return args

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def select_rows(self, rows: torch.Tensor) -> "PackedLinear":
        """The same format restricted to output channels ``rows`` (copied)."""
        if self.fmt == "w4a8":
            return _w4_select_rows(self, rows)
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


# Candidate grids per block of 32. Symmetric (offset 0): the block's largest-magnitude value v maps to -c (c
# below), so q = -8 is used; smaller c clip less often, larger c round finer. Affine: the block's range split
# into n steps from its minimum (q = -8), which is how GGUF's Q4_K stores a block (n = its largest q minus its
# smallest). The candidate with the least squared error wins.
_W4_DIVISORS = (8.0, 7.75, 7.5, 7.25, 7.0, 6.75, 6.5, 6.0)
_W4_SPANS = (15, 14, 13, 12, 11, 10)


def _w4_search(blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, offset) of the candidate grid with the least squared error for each block of ``blk [B, 32]``;
    scale and offset as the kernel sees them (fp16 values, in float32), shapes [B, 32], [B, 1], [B, 1]."""
    v = blk.gather(1, blk.abs().argmax(dim=1, keepdim=True))  # signed extreme of each block
    lo, hi = blk.amin(dim=1, keepdim=True), blk.amax(dim=1, keepdim=True)
    zero = torch.zeros_like(v)
    grids = [((-v / c).half().float(), zero) for c in _W4_DIVISORS]
    grids += [_affine(lo, hi, n) for n in _W4_SPANS]
    best_err = best_q = best_s = best_o = None
    for s, o in grids:  # the kernel multiplies by the fp16 scale and offset: quantize against them
        qq = _on_grid(blk, s, o)
        err = (qq * s - o - blk).pow_(2).sum(dim=1, keepdim=True)
        if best_err is None:
            best_err, best_q, best_s, best_o = err, qq, s, o
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_q = torch.where(better, qq, best_q)
            best_s = torch.where(better, s, best_s)
            best_o = torch.where(better, o, best_o)
    return best_q, best_s, best_o


def _affine(lo: torch.Tensor, hi: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = ((hi - lo) / n).half().float()
    return s, (-8.0 * s - lo).half().float()


def _on_grid(blk: torch.Tensor, s: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
    return torch.round((blk + o) * inv).clamp_(-8, 7)


def _quantize_w4(w: torch.Tensor) -> PackedLinear:
    N, K = w.shape
    Kp = _round_up(K, ACT_BLOCK)
    nb = Kp // ACT_BLOCK
    q = torch.zeros(N, Kp, dtype=torch.int8, device=w.device)
    sc = torch.zeros(N, nb, dtype=torch.float16, device=w.device)
    off = torch.zeros(N, nb, dtype=torch.float16, device=w.device)
    step = max(1, (1 << 20) // Kp)
    for n0 in range(0, N, step):
        blk = F.pad(w[n0:n0 + step].float(), (0, Kp - K)).view(-1, ACT_BLOCK)
        # Blocks that already lie on a 15-step affine grid (a Q4_K block spanning all 16 levels, most of them in
        # a Q4_K checkpoint) keep it: up to the fp16 rounding of its scale and offset nothing fits better, and the
        # full search is only run for the rest.
        s, o = _affine(blk.amin(dim=1, keepdim=True), blk.amax(dim=1, keepdim=True), _W4_SPANS[0])
        qq = _on_grid(blk, s, o)
        fit = ((qq * s - o - blk).abs() <= 0.01 * s + 2.0 ** -10 * o.abs()).all(dim=1)
        rest = (~fit).nonzero().squeeze(1)
        if len(rest):
            qq[rest], s[rest], o[rest] = _w4_search(blk[rest])
        q[n0:n0 + step] = qq.view(-1, Kp).to(torch.int8)
        sc[n0:n0 + step] = s.view(-1, nb).half()
        off[n0:n0 + step] = o.view(-1, nb).half()
    return _w4_pack(q, sc, off, K)


def _w4_pack(q: torch.Tensor, sc: torch.Tensor, off: torch.Tensor | None, K: int) -> PackedLinear:
    """int8 ``q [N, Kp]`` (-8..7), fp16 ``sc [N, Kp / 32]`` and fp16 offsets of the same shape (or None: all
    0) -> the kernel's w4a8 layout: per group of 16 channels and quarter of 8 K values, 64 bytes; lane l's byte i
    holds q+8 of k0+i (low nibble) and of k0+4+i (high nibble). Padding channels are 0 with scale 0. Offsets that
    are all 0 are left out (the format without them, whose kernel skips their epilogue)."""
    N, Kp = q.shape
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(N, Kp // ACT_BLOCK, 4, 2, 4)  # [n, block, quarter, nibble, byte]
    return _w4_layout(u[:, :, :, 0] | (u[:, :, :, 1] << 4), sc, off, K)


def _w4_layout(byte: torch.Tensor, sc: torch.Tensor, off: torch.Tensor | None, K: int) -> PackedLinear:
    """Each channel's bytes ``[N, block, quarter, byte]`` (two of its nibbles per byte), scales and offsets ->
    the kernel's layout (see ``_w4_pack``): channels padded to groups of 16 and interleaved per quarter."""
    N, nb = byte.shape[:2]
    G = -(-N // W8A8_GROUP)
    padded = torch.full((G * W8A8_GROUP, nb, 4, 4), 0x88, dtype=torch.uint8, device=byte.device)  # q = 0
    padded[:N] = byte
    weight = padded.view(G, W8A8_GROUP, nb, 4, 4).permute(0, 2, 3, 1, 4).contiguous().view(G, nb * 256)

    def by_group(t: torch.Tensor) -> torch.Tensor:  # [N, nb] -> [G, nb * 16], channels innermost
        out = torch.zeros(G * W8A8_GROUP, nb, dtype=torch.float16, device=byte.device)
        out[:N] = t
        return out.view(G, W8A8_GROUP, nb).permute(0, 2, 1).contiguous().view(G, nb * W8A8_GROUP)

    scale = by_group(sc) if off is None or not bool(off.any()) else torch.stack([by_group(sc), by_group(off)])
    return PackedLinear("w4a8", weight, scale, K, N)


def _w4_rows(packed: PackedLinear, rows: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The bytes ``[n, block, quarter, byte]``, scales and offsets (or None) of just the channels ``rows`` (in
    that order), touching only their bytes: a draft head picks rows out of a 150k-row weight at run time."""
    rows = rows.to(packed.weight.device)
    G = packed.weight.shape[0]
    nb = packed.weight.shape[1] * 2 // W8A8_GROUP // ACT_BLOCK
    g, lane = rows // W8A8_GROUP, rows % W8A8_GROUP
    byte = packed.weight.view(G, nb, 4, W8A8_GROUP, 4)[g, :, :, lane, :]
    tables = packed.scale if packed.scale.ndim == 3 else packed.scale[None]
    s, *o = (t.view(G, nb, W8A8_GROUP)[g, :, lane] for t in tables)
    return byte, s, (o[0] if o else None)


def _w4_select_rows(packed: PackedLinear, rows: torch.Tensor) -> PackedLinear:
    """``packed`` restricted to channels ``rows``: their bytes are moved whole (a byte holds two nibbles of one
    channel), so a 150k-row draft head is cut without unpacking it."""
    return _w4_layout(*_w4_rows(packed, rows), packed.in_features)


def _w4_unpack(packed: PackedLinear, n0: int = 0, n1: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Logical ``q [n1 - n0, Kp]`` (int8, -8..7), fp16 scales ``[n1 - n0, Kp / 32]`` and offsets (or None) of a
    w4a8 weight."""
    n1 = packed.out_features if n1 is None else min(n1, packed.out_features)
    return _w4_unpack_rows(packed, torch.arange(n0, n1))


def _w4_unpack_rows(packed: PackedLinear, rows: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Logical ``q``, scales and offsets of just the channels ``rows`` (in that order)."""
    byte, s, off = _w4_rows(packed, rows)
    u = torch.stack([byte & 0x0F, byte >> 4], dim=3)  # [n, block, quarter, nibble, byte]
    return u.reshape(len(byte), -1).to(torch.int8) - 8, s, off


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
        q, sc, off = _w4_unpack(packed, n0, n1)
        w = q.float().view(q.shape[0], -1, ACT_BLOCK) * sc.float()[:, :, None]
        if off is not None:
            w = w - off.float()[:, :, None]
        w = w.view(q.shape[0], -1)
        return w[:, :packed.in_features]
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
