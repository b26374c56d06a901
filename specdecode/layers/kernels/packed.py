"""PackedLinear, a weight in one of the kernel's formats, and the functions that make and read one."""
from __future__ import annotations

import torch

from specdecode.layers.kernels.formats import (_FMT_CODE, _K_ALIGN, _WEIGHT_DTYPE, ACT_BLOCK, FORMATS,
                                               W6_BLOCK_BYTES, W8A8_GROUP, _round_up)
from specdecode.layers.kernels.int8 import _interleave, _w8a8_rows, quantize_int8
from specdecode.layers.kernels.q4 import (W4Fields, _quantize_w4, _w4_layout, _w4_rows, _w4_scale_bytes,
                                          _w4_unpack, q4k_fields, w4_layout, w4_weights)
from specdecode.layers.kernels.q6 import (W6Fields, _quantize_w6, _w6_scale_bytes, _w6_unpack_rows, q6k_fields,
                                          w6_layout, w6_weights)
from specdecode.layers.kernels.q8 import Q8Fields, _q8_rows, _quantize_q8, q8_0_fields, q8_layout, q8_weights


class PackedLinear:
    """A weight prepared for the kernel.

    ``weight`` is ``[N, Kp]`` (Kp = K rounded up to a multiple of 8, zero padded) of dtype float32,
    bfloat16 or int8 depending on ``fmt``; for w8a8 it is uint8 ``[ceil(N / 16), Kp * 16]`` in the
    interleaved layout (``int8._interleave``), for w4a8 uint8 ``[ceil(N / 16), Kp * 8]`` (``q4._w4_layout``), for
    w6a8 uint8 ``[ceil(N / 16), Kp * 12]`` (``q6.w6_layout``). ``scale`` is float32 ``[N]`` for int8 and w8a8; for
    w4a8 uint8 ``[ceil(N / 16), _w4_scale_bytes(Kp)]``, each group's block codes and then its fp16 units (and for
    w6a8 likewise, ``_w6_scale_bytes(Kp)``); q8_0's weight is w8a8's and its scale float16 ``[ceil(N / 16), Kp / 2]``
    (``q8.q8_layout``); else None.
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
        if self.fmt in ("w8a8", "q8_0"):
            Kp = w.shape[1] // W8A8_GROUP if w.ndim == 2 else 0
            if (w.dtype != torch.uint8 or w.ndim != 2 or not w.is_contiguous() or not w.is_cpu
                    or w.shape[0] != -(-N // W8A8_GROUP) or Kp < K or Kp % _K_ALIGN["w8a8"]
                    or w.shape[1] != Kp * W8A8_GROUP or (self.fmt == "q8_0" and (
                        scale is None or scale.dtype != torch.float16 or not scale.is_contiguous()
                        or not scale.is_cpu or tuple(scale.shape) != (w.shape[0], Kp // ACT_BLOCK * W8A8_GROUP)))):
                raise ValueError(f"{self.fmt}_linear: malformed interleaved weight {tuple(w.shape)} {w.dtype} for "
                                 f"{self!r}")
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
        elif self.fmt not in ("w4a8", "w6a8", "q8_0"):  # their codes and units were checked above
            scale = None
        args = (w.data_ptr(), stride, _FMT_CODE[self.fmt], scale)
        self._checked = (key, args)
        return args

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def select_rows(self, rows: torch.Tensor) -> PackedLinear:
        """The same format restricted to output channels ``rows`` (copied)."""
        if self.fmt == "w4a8":  # a byte holds two nibbles of one channel: bytes move whole, nothing is unpacked
            return PackedLinear("w4a8", *_w4_layout(*_w4_rows(self, rows)), self.in_features, len(rows))
        if self.fmt == "w6a8":
            return pack_w6(_w6_unpack_rows(self, rows), self.in_features)
        if self.fmt == "q8_0":
            f = _q8_rows(self, 0, self.out_features)
            return pack_q8(Q8Fields(f.u[rows], f.d[rows]), self.in_features)
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
        return pack_w4(_quantize_w4(w), K)
    if fmt == "w6a8":
        return pack_w6(_quantize_w6(w), K)
    if fmt == "q8_0":
        return pack_q8(_quantize_q8(w), K)

    q, scale = quantize_int8(w, Kp)
    if fmt == "w8a8":  # unsigned storage for vpdpbusd; padding becomes 128, i.e. weight 0
        return PackedLinear(fmt, _interleave((q.to(torch.int16) + 128).to(torch.uint8)), scale, K, N)
    return PackedLinear(fmt, q, scale, K)


def pack_w4(f: W4Fields, K: int) -> PackedLinear:
    """Logical w4a8 fields -> a packed weight (q4.w4_layout)."""
    return PackedLinear("w4a8", *w4_layout(f), K, f.u.shape[0])


def pack_q4k(blocks: torch.Tensor, K: int) -> PackedLinear:
    """``pack_linear(dequantized Q4_K weight, "w4a8")`` without the search: the Q4_K blocks as stored."""
    if K % 256:
        raise ValueError(f"pack_q4k: a Q4_K row holds a multiple of 256 weights, got {K}")
    return pack_w4(q4k_fields(blocks, K), K)


def pack_w6(f: W6Fields, K: int) -> PackedLinear:
    """Logical w6a8 fields -> a packed weight (q6.w6_layout)."""
    return PackedLinear("w6a8", *w6_layout(f), K, f.u.shape[0])


def pack_q6k(blocks: torch.Tensor, K: int) -> PackedLinear:
    """A GGUF Q6_K tensor as stored -> w6a8 holding exactly its weights."""
    return pack_w6(q6k_fields(blocks, K), K)


def pack_q8(f: Q8Fields, K: int) -> PackedLinear:
    """Logical q8_0 fields -> a packed weight (q8.q8_layout)."""
    return PackedLinear("q8_0", *q8_layout(f), K, f.u.shape[0])


def pack_q8_0(blocks: torch.Tensor, K: int) -> PackedLinear:
    """A GGUF Q8_0 tensor as stored -> q8_0 holding exactly its weights (its int8 values and fp16 scales)."""
    return pack_q8(q8_0_fields(blocks, K), K)


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
    if packed.fmt == "q8_0":
        return q8_weights(_q8_rows(packed, n0, n1), packed.in_features)
    if packed.fmt == "w8a8":
        n1 = min(n1, packed.out_features)
        w = _w8a8_rows(packed, n0, n1)[:, :packed.in_features].to(torch.int16) - 128
    else:
        w = packed.weight[n0:n1, :packed.in_features]
    return w.float() * packed.scale[n0:n1, None] if packed.scale is not None else w.float()

