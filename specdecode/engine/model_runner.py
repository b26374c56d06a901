"""Runs one model over the engine's cache slots.

The runner's KVCache (engine/kv_cache.py) holds every layer's keys and values, in blocks of a BlockPool
(engine/block_pool.py) that the target's and the draft's runners share. The runner never tracks lengths;
each request's computed length lives in the request and is passed in as the start position, so rolling back
rejected drafts is just lowering that number. Before a pass writes new positions, the runner makes sure
their blocks exist (``KVCache.ensure``).
"""
from __future__ import annotations

import torch

from specdecode.engine.block_pool import BlockPool
from specdecode.engine.kv_cache import KVCache
from specdecode.layers.attention import Attention, ForwardBatch
from specdecode.models.loader import LoadedModel


class ModelRunner:
    def __init__(self, loaded: LoadedModel, max_num_seqs: int, max_model_len: int, device: str,
                 kv_cache_dtype: str = "auto", pool: BlockPool | None = None, draft: bool = False):
        """kv_cache_dtype: "auto" (16-bit on CPU, the model dtype elsewhere), "float16", "bfloat16",
        "float32" or "int8" (see engine.kv_cache). pool: the blocks to use (shared with another runner), or None for
        a pool of this runner's own with room for max_num_seqs sequences of max_model_len. draft: a draft
        model's runner, whose cache follows the pool's draft table (a slot's bounded draft window)."""
        self.model = loaded.model
        self.hf_config = loaded.hf_config
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.vocab_size = self.model.args.vocab_size
        self.num_passes = 0  # decode/verify forward passes; the bench turns them into weight bytes read
        self.kv_cache = KVCache.for_model(self.model, max_num_seqs, max_model_len, kv_cache_dtype, self.device,
                                          pool, draft)
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for i, m in enumerate(layers):
            m.bind_kv_cache(self.kv_cache, i)

    @property
    def chunks_start_anywhere(self) -> bool:
        """Whether a prompt chunk may start inside a block and still give bitwise the results of a whole
        prefill: true where prompt rows take the C++ layer stack, which computes every row alone (the
        Python path's prefill is exact for chunks that start on block boundaries, see layers.attention)."""
        return self.model._layer_stack() is not None

    def _tensor(self, xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    def prefill(self, slot: int, token_ids: list[int], start: int = 0) -> torch.Tensor:
        """Computes KV for token_ids at positions start.. and returns the last token's logits [V]."""
        return self.prefill_many([(slot, start, token_ids)])[0]

    def prefill_many(self, seqs: list[tuple[int, int, list[int]]],
                     all_logits: list[bool] | None = None) -> list[torch.Tensor]:
        """Prompt chunks of several slots in one pass, seqs: (slot, start position, tokens). Returns each
        chunk's last-token logits [V], or where ``all_logits[i]``, every row's [len(tokens), V]. Each chunk's
        keys, values and logits are those of prefilling it alone: the linears are row-invariant and attention
        runs per chunk (layers.attention)."""
        if not all(toks for _, _, toks in seqs):
            raise ValueError("prefill_many: an empty chunk")
        every = all_logits or [False] * len(seqs)
        return [lg if e else lg[0] for lg, e in zip(self._pass(seqs, every, prefill=True), every)]

    def forward_rows(self, seqs: list[tuple[int, int, list[int]]],
                     all_logits: bool | list[bool]) -> list[torch.Tensor]:
        """seqs: (slot, start position, new tokens). Row-invariant path.

        Returns per sequence the logits [len(tokens), V] if all_logits (one flag, or one per sequence), else
        the last row's [1, V]."""
        self.num_passes += 1
        return self._pass(seqs, all_logits if isinstance(all_logits, list) else [all_logits] * len(seqs),
                          prefill=False)

    def _pass(self, seqs: list[tuple[int, int, list[int]]], all_logits: list[bool],
              prefill: bool) -> list[torch.Tensor]:
        """One forward pass over ``seqs``: per sequence its logits [len(tokens), V] where ``all_logits``, else
        its last row's [1, V]."""
        ids, pos, slots, rows, spans = [], [], [], [], []
        for (slot, start, toks), every_row in zip(seqs, all_logits):
            self.kv_cache.ensure(slot, start + len(toks))
            base = len(ids)
            ids += toks
            pos += range(start, start + len(toks))
            slots += [slot] * len(toks)
            if every_row:
                spans.append((len(rows), len(toks)))
                rows += range(base, base + len(toks))
            else:
                spans.append((len(rows), 1))
                rows.append(base + len(toks) - 1)
        b = ForwardBatch(self._tensor(ids), self._tensor(pos), self._tensor(slots), slots, pos,
                         prefill=prefill, logits_rows=self._tensor(rows))
        logits = self.model(b)
        return [logits[s:s + n] for s, n in spans]
