"""What the layers need of the engine's paged KV cache (engine.kv_cache.KVCache implements it).

The engine builds the cache and binds it to each Attention layer (``Attention.bind_kv_cache``); the layers and
the model see it only through ``PagedKVCache``, so they depend on no engine module.
"""
from __future__ import annotations

from typing import Protocol

import torch

# Positions per cache block. The C++ attention's key tile (layers.kernels.KEY_TILE, asserted equal in
# engine.kv_cache); prefill chunks end on block boundaries and the Python prefill attends block by block.
BLOCK_SIZE = 16


class PagedKVCache(Protocol):
    """A KV cache in blocks of ``BLOCK_SIZE`` positions, found per slot through ``block_table``."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    block_table: torch.Tensor  # [slots, blocks per slot]: the block holding each slot's positions 16 i .. 16 i + 15

    def locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset in block) of each (slot, position), as index tensors for ``write``."""
        ...

    def write(self, layer: int, loc: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([N, KV, D]) of layer ``layer`` at the positions ``loc`` (from ``locate``)."""
        ...

    def read(self, layer: int, slot: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, end) of ``slot`` in layer ``layer`` as (keys, values), each [KV, end, D] in ``dtype``."""
        ...

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's raw storage (keys, values), for the C++ layer stack (models.model)."""
        ...

    def scales(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer i's per-position scales (keys', values') of an int8 cache, None for a float one."""
        ...
