"""A token embedding whose table stays in the checkpoint's own encoding and is decoded row by row on lookup.

Why: a 150k-token vocabulary makes the embedding table as large as a quarter of a 1.5B model. Held in float32
it costs more memory than all the w8a8 layers' weights; kept in its checkpoint encoding (GGUF blocks such as
Q4_K, or bf16 / fp16 from safetensors) and memory-mapped from the packed-weight cache, it costs only the pages
of the tokens actually looked up. Each looked-up row is decoded by the same function the full-table loader
uses, so the float32 rows are bitwise those of the dense table: outputs do not change.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn as nn

DENSE = "dense"  # ``table`` is a [V, H] float tensor; anything else names a GGML block type (e.g. "Q4_K")
# Decode and verification steps look up a few tokens each, mostly the same common ones, and decoding a GGML
# row goes through numpy calls whose fixed cost dwarfs the row's: so the rows of lookups of up to
# _CACHED_LOOKUP tokens are kept, least recently used first out, in up to _ROW_CACHE_BYTES per table.
_CACHED_LOOKUP = 16
_ROW_CACHE_BYTES = 8 << 20


class PackedEmbedding(nn.Module):
    """``ids -> float32 rows`` from ``table``: a [V, H] float tensor (``encoding == "dense"``), or the raw
    GGML blocks of each row, uint8 [V, row_bytes] (``encoding`` is the GGML type name, e.g. "Q4_K")."""

    def __init__(self, table: torch.Tensor, encoding: str, num_embeddings: int, embedding_dim: int):
        super().__init__()
        if table.ndim != 2 or table.shape[0] != num_embeddings:
            raise ValueError(f"PackedEmbedding: table of shape {tuple(table.shape)} does not hold "
                             f"{num_embeddings} rows")
        if encoding == DENSE and (table.shape[1] != embedding_dim or not table.is_floating_point()):
            raise ValueError(f"PackedEmbedding: a dense table must be float [{num_embeddings}, {embedding_dim}]")
        if encoding != DENSE:
            from gguf import GGMLQuantizationType

            self._qtype = int(GGMLQuantizationType[encoding])
            if table.dtype != torch.uint8:
                raise ValueError("PackedEmbedding: GGML rows must be a uint8 tensor")
        self.table = table  # a plain attribute: never part of a state_dict
        self.encoding = encoding
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # The table the rows decode to, as nn.Embedding.weight would describe it (shape and dtype, no data).
        self.weight = torch.empty(num_embeddings, embedding_dim, dtype=torch.float32, device="meta")
        self._rows: OrderedDict[int, torch.Tensor] = OrderedDict()  # decoded rows of recent small lookups
        self._max_rows = max(1, _ROW_CACHE_BYTES // (4 * embedding_dim))

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(device=self.table.device, dtype=torch.long)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        if self.encoding == DENSE:
            out = self.table.index_select(0, flat).float()
        elif 0 < len(flat) <= _CACHED_LOOKUP:
            out = self._cached_rows(flat.tolist())
        else:
            out = self._decode(flat) if len(flat) else torch.empty(0, self.embedding_dim, dtype=torch.float32)
        return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def _decode(self, flat: torch.Tensor) -> torch.Tensor:
        from specdecode.models.gguf_loader import dequantize_rows

        return dequantize_rows(self.table.index_select(0, flat), self._qtype, self.embedding_dim)

    def _cached_rows(self, ids: list[int]) -> torch.Tensor:
        """The rows of ``ids``, decoded once (the same function, so the same bits) and kept while recently used."""
        rows = self._rows
        missing = [t for t in dict.fromkeys(ids) if t not in rows]
        if missing:
            for t, row in zip(missing, self._decode(torch.tensor(missing, dtype=torch.long))):
                rows[t] = row.clone()
        for t in ids:
            rows.move_to_end(t)
        out = torch.stack([rows[t] for t in ids])
        while len(rows) > self._max_rows:
            rows.popitem(last=False)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, encoding={self.encoding}"
