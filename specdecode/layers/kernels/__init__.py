"""Row-invariant CPU linear kernel: the package's public API (this module re-exports it).

``rowinv_linear(x, packed)`` computes ``x @ W.T (+ bias)`` such that output row i is bitwise identical
whatever M is, whatever the other rows contain and whatever ``torch.get_num_threads()`` is: every
(row, output channel) dot product is reduced over K in one fixed order, and threads split only the
output channels. A forward over M <= 64 rows reads each weight once, so verifying k draft tokens
costs little more than decoding one.

The C++ sources (``csrc/``, shipped as package data) are one extension, built on first use (``extension``: the
build, the load, ``SPECDECODE_DISABLE_KERNEL`` and ``extension.FORCE_FALLBACK``); without it a slow but still
row-invariant pure-torch path is used (``fallback``).

Weight formats (``pack_linear``):
  * ``fp32``: float32 weight.
  * ``bf16``: bfloat16 weight (round-to-nearest-even from wider types), widened to fp32 in-register.
  * ``int8``: symmetric per-output-channel quantization, ``scale = absmax / 127``,
    ``q = round(w / scale)``; the kernel computes ``(x . q) * scale`` with fp32 activations.
  * ``w8a8``: the same int8 weights (stored as ``q + 128`` in uint8, K padded to a multiple of 32, and
    interleaved in groups of 16 channels x 4 bytes for the integer dot-product instructions: ``int8._interleave``),
    multiplied by activations that the kernel quantizes per row in blocks of 32 (``quantize_activations``),
    with exact integer dot products (AVX-512 VNNI or AVX2). Integer sums have no order, so row
    invariance is free, and a pass over several rows costs little more than over one.
  * ``w4a8``: 4-bit weights in GGUF Q4_K's layout: ``w = s * u - o`` with u in 0..15 and, per block of 32
    weights of a channel, ``s = D * cs`` and ``o = Dm * co`` (int8 codes ``cs``, ``co``; fp16 units ``D``, ``Dm``
    shared by 8 blocks), 18.5 bytes per 32 weights, with the same quantized activations and integer dot
    products. A Q4_K tensor is taken as stored (``pack_q4k``: its d, dmin, 6-bit scales and minimums), so a
    Q4_K_M checkpoint keeps its exact weights at about half the bytes of w8a8; other weights get per block the
    best of a few symmetric and affine grids (``q4._quantize_w4``).
  * ``w6a8``: 6-bit weights in GGUF Q6_K's layout: ``w = D * sc * (u - 32)`` with u in 0..63, an int8 code ``sc``
    per 16 weights and an fp16 unit ``D`` per 256 (6.5625 bits a weight), with the same quantized activations
    and exact integer sums. A Q6_K tensor is taken as stored (``pack_q6k``); other weights get per 16 the
    scale that puts their extreme on the grid (``q6._quantize_w6``).
  * ``q8_0``: GGUF Q8_0's blocks, ``w = d * q`` per 32 weights of a channel (int8 q, fp16 d), 8.5 bits a weight:
    w8a8's interleaved int8 weights with a d per (channel, block) instead of a scale per channel, and the same
    quantized activations and exact integer sums. A Q8_0 tensor is taken as stored (``pack_q8_0``); other weights
    are quantized as gguf-py quantizes to Q8_0 (``q8._quantize_q8``).
For fp32/bf16/int8, activations and accumulation are fp32.

Non-CPU inputs (e.g. CUDA) use ``F.linear`` on a dequantized weight cached on that device; bitwise row
invariance is NOT guaranteed there.

Modules: ``formats`` (names, codes, alignments), ``int8`` (int8 / w8a8 and the activations' quantization), ``q4``
(w4a8 / Q4_K), ``q6`` (w6a8 / Q6_K), ``q8`` (q8_0), ``packed`` (PackedLinear and packing), ``extension``, ``fallback``, ``rowinv``
(rowinv_linear and its torch.compile op), ``layer_stack`` (the decoder layers in one call).
"""
from __future__ import annotations

from specdecode.layers.kernels.extension import (amx_active, describe, kernel_available, kernel_info, set_amx,
                                                 source_digest, top_probability, words_sums)
from specdecode.layers.kernels.formats import (ACT_BLOCK, FORMATS, GROUPED_SCALES, INT_ACTS, QUANTIZED, W4_SUPER,
                                               W6_BLOCK_BYTES, W8A8_GROUP)
from specdecode.layers.kernels.int8 import quantize_activations
from specdecode.layers.kernels.layer_stack import KEY_TILE, KV_DTYPES, LayerStack
from specdecode.layers.kernels.packed import (PackedLinear, dequantize, pack_linear, pack_q4k, pack_q6k, pack_q8,
                                              pack_q8_0, pack_w4, pack_w6)
from specdecode.layers.kernels.q4 import W4Fields, cat_fields, q4k_fields, w4_weights
from specdecode.layers.kernels.q6 import W6Fields, q6k_fields, w6_weights
from specdecode.layers.kernels.q8 import Q8Fields, q8_0_fields, q8_weights
from specdecode.layers.kernels.rowinv import rowinv_linear, rowinv_linear_op

__all__ = ["ACT_BLOCK", "FORMATS", "GROUPED_SCALES", "INT_ACTS", "KEY_TILE", "KV_DTYPES", "QUANTIZED", "W4_SUPER",
           "W6_BLOCK_BYTES", "W8A8_GROUP", "LayerStack", "PackedLinear", "Q8Fields", "W4Fields", "W6Fields",
           "amx_active", "cat_fields", "dequantize", "describe", "kernel_available", "kernel_info", "pack_linear",
           "pack_q4k", "pack_q6k", "pack_q8", "pack_q8_0", "pack_w4", "pack_w6", "q4k_fields", "q6k_fields",
           "q8_0_fields", "q8_weights", "quantize_activations", "rowinv_linear", "rowinv_linear_op", "set_amx",
           "source_digest", "top_probability", "w4_weights", "w6_weights", "words_sums"]
