"""The packed weight formats' names, kernel codes, storage dtypes and alignments (see the package docstring)."""
from __future__ import annotations

import torch

FORMATS = ("fp32", "bf16", "int8", "w8a8", "w4a8", "w6a8", "q8_0")
_FMT_CODE = {"fp32": 0, "bf16": 1, "int8": 2, "w8a8": 3, "w4a8": 4, "w6a8": 5, "q8_0": 6}
_WEIGHT_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "w8a8": torch.uint8,
                 "w4a8": torch.uint8, "w6a8": torch.uint8, "q8_0": torch.uint8}
_K_ALIGN = {"fp32": 8, "bf16": 8, "int8": 8, "w8a8": 32, "w4a8": 32, "w6a8": 32, "q8_0": 32}
QUANTIZED = ("int8", "w8a8", "w4a8", "w6a8", "q8_0")  # formats that replace the float weight (Linear.prepare)
INT_ACTS = ("w8a8", "w4a8", "w6a8", "q8_0")  # formats whose kernel also quantizes the activations (quantize_activations)
W8A8_GROUP = 16  # channels per interleaved w8a8 weight group
ACT_BLOCK = 32  # w8a8 activation quantization block (along K)
W4_SUPER = 8  # w4a8 blocks of 32 that share one fp16 scale unit and one offset unit (Q4_K's 256 weights)
# formats whose scale tensor is laid out per 16-channel group like the weight (rows of it: groups, not channels)
GROUPED_SCALES = ("w4a8", "w6a8", "q8_0")
W6_BLOCK_BYTES = 384  # bytes of one w6a8 group's block of 32 K values: 4 vectors of low nibbles, 2 of high bits


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m

