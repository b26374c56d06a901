"""The KV cache's blocks: allocation, reference counts and the prefix cache.

A block holds ``BLOCK_SIZE`` consecutive positions of one sequence in every layer of a model. The pool hands
out block ids; ``block_table[slot, i]`` names the block holding positions ``16 i .. 16 i + 15`` of a cache slot.
The target's and the draft model's KVCache share one pool and so one table: a block id means the same
positions in both caches (each has its own storage for it).

Prefix caching. A full block whose keys and values were computed (by a prompt's prefill, or by decode steps:
a chat's next turn re-sends the answer) is *registered* under its content: the identity of the registered
block before it plus its 16 token ids. A later sequence that starts with the same tokens takes a reference to
those blocks instead of computing them again. The key is compared exactly (a dict of tuples, no digest), so
two different prefixes never share a block. A cache hit gives bitwise the keys and values that computing them
would: every position is computed the same way whatever shares its pass and wherever its chunk starts
(models.model: prompt rows take the decode rows' row-invariant path where the C++ layer stack runs).

A sequence's last, partly filled block is registered too, as a *partial* entry: the parent's identity and
the tokens it holds so far. Its owner only ever writes past them, so a later sequence that continues the same
prefix with some of those tokens copies their keys and values into a block of its own
(``match_partial``, used where a prompt chunk may start inside a block: engine.model_runner). So an
exact repeat of a prompt computes only its last token, as llama-server's slot cache does.

Blocks nobody references stay cached, in least-recently-released order, and are evicted only when a fresh
block is needed. Each registered block records whether the draft model's cache holds it too.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

# Defined with the cache interface the layers see (layers.paged_kv); re-exported for the engine and its users.
from specdecode.layers.paged_kv import BLOCK_SIZE


class KVCacheFullError(RuntimeError):
    """The KV cache has no free block left for a sequence's next positions."""


class _Cached:
    __slots__ = ("key", "content_id", "draft_ok")

    def __init__(self, key: tuple, content_id: int, draft_ok: bool):
        self.key, self.content_id, self.draft_ok = key, content_id, draft_ok


class BlockPool:
    def __init__(self, num_blocks: int, num_slots: int, blocks_per_slot: int, device: torch.device | str,
                 enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks, self.num_slots, self.blocks_per_slot = num_blocks, num_slots, blocks_per_slot
        self.enable_prefix_caching = enable_prefix_caching
        # Entries a slot does not hold point at block 0: never read, since readers stay below the lengths given.
        self.block_table = torch.zeros(num_slots, blocks_per_slot, dtype=torch.int64, device=device)
        self._slot_blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # never used, or released and not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._cached: dict[int, _Cached] = {}             # block -> its registration
        self._by_key: dict[tuple, int] = {}                # (parent content id, tokens) -> block
        self._partial_of: dict[int, tuple[int, tuple]] = {}  # block -> (parent content id, its tokens so far)
        self._partials: dict[int, dict[int, tuple]] = {}     # parent content id -> {block: its tokens so far}
        self._next_content_id = 1                          # 0 is the empty prefix
        # vLLM's prefix cache counters, in tokens: positions looked up and positions found
        self.queries = 0
        self.hits = 0

    # ---- sizes ----
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take now: never used, released, or cached and unreferenced (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one slot."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks(self, slot: int) -> list[int]:
        """The slot's blocks, in position order (do not modify)."""
        return self._slot_blocks[slot]

    def held(self, slot: int) -> int:
        """Positions the blocks of ``slot`` cover."""
        return len(self._slot_blocks[slot]) * BLOCK_SIZE

    def blocks_needed(self, slot: int | None, num_tokens: int) -> int:
        """Fresh blocks ``slot`` (None: an empty one) needs to hold positions [0, num_tokens)."""
        have = 0 if slot is None else len(self._slot_blocks[slot])
        return max(0, -(-num_tokens // BLOCK_SIZE) - have)

    # ---- allocation ----
    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        else:
            raise KVCacheFullError(f"The KV cache is full ({self.num_blocks} blocks of {BLOCK_SIZE} positions).")
        self._refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        entry = self._cached.pop(block, None)
        if entry is not None and self._by_key.get(entry.key) == block:
            del self._by_key[entry.key]
        self._drop_partial(block)

    def _drop_partial(self, block: int) -> None:
        part = self._partial_of.pop(block, None)
        if part is not None:
            siblings = self._partials[part[0]]
            del siblings[block]
            if not siblings:
                del self._partials[part[0]]

    def _keeps(self, block: int) -> bool:
        """Whether an unreferenced block is worth keeping (evictable) rather than free."""
        return block in self._cached or block in self._partial_of

    def ensure(self, slot: int, num_tokens: int) -> None:
        """Give ``slot`` blocks for positions [0, num_tokens); raises KVCacheFullError (taking nothing) when the
        pool cannot."""
        blocks = self._slot_blocks[slot]
        n = -(-num_tokens // BLOCK_SIZE)
        if n > self.blocks_per_slot:
            raise ValueError(f"{num_tokens} positions exceed the cache's max_model_len "
                             f"({self.blocks_per_slot * BLOCK_SIZE}).")
        if n - len(blocks) > self.num_free_blocks:
            raise KVCacheFullError(f"The KV cache is full: {n - len(blocks)} more blocks needed, "
                                   f"{self.num_free_blocks} of {self.num_blocks} free.")
        while len(blocks) < n:
            block = self._take()
            self.block_table[slot, len(blocks)] = block
            blocks.append(block)

    def free(self, slot: int) -> None:
        """Drop the slot's references. Registered blocks stay cached until evicted; the rest are free."""
        for block in reversed(self._slot_blocks[slot]):  # the tail first: the prefix stays cached longest
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._keeps(block):
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        self._slot_blocks[slot] = []

    # ---- prefix cache ----
    def match(self, token_ids: list[int], max_tokens: int) -> tuple[list[int], int]:
        """The registered blocks that hold the longest prefix of ``token_ids`` of at most ``max_tokens``
        positions, and how many of them lead with the draft model's keys and values too."""
        blocks: list[int] = []
        draft_run = 0
        if not self.enable_prefix_caching:
            return blocks, draft_run
        parent = 0
        for i in range(max_tokens // BLOCK_SIZE):
            block = self._by_key.get((parent, tuple(token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])))
            if block is None:
                break
            entry = self._cached[block]
            if entry.draft_ok and draft_run == len(blocks):
                draft_run += 1
            blocks.append(block)
            parent = entry.content_id
        return blocks, draft_run

    def match_partial(self, token_ids: list[int], blocks: list[int], max_tokens: int) -> tuple[int, int] | None:
        """After ``blocks`` (from ``match``): a block whose first n positions hold the next tokens of
        ``token_ids`` (at most ``max_tokens`` positions in all), as (block, n) with the largest n, or None."""
        if not self.enable_prefix_caching:
            return None
        parent = self._cached[blocks[-1]].content_id if blocks else 0
        start = len(blocks) * BLOCK_SIZE
        want = token_ids[start:min(max_tokens, start + BLOCK_SIZE)]
        best = None
        for block, held in self._partials.get(parent, {}).items():
            n = 0
            while n < len(held) and n < len(want) and held[n] == want[n]:
                n += 1
            if n and (best is None or n > best[1]):
                best = (block, n)
        return best

    def attach(self, slot: int, blocks: list[int]) -> None:
        """Make ``blocks`` (from ``match``) the first blocks of the slot, sharing them (what it held is
        released)."""
        self.free(slot)
        for i, block in enumerate(blocks):
            if self._refs[block] == 0:
                self._evictable.pop(block, None)
            self._refs[block] += 1
            self.block_table[slot, i] = block
        self._slot_blocks[slot] = list(blocks)

    def count_query(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit

    def register(self, slot: int, token_ids: list[int], num_tokens: int, draft_tokens: int) -> None:
        """Register the slot's full blocks of positions [0, num_tokens), computed (by prefill or decode steps)
        from ``token_ids``, and the partly filled block after them as a partial entry; the draft's cache holds
        positions [0, draft_tokens)."""
        if not self.enable_prefix_caching:
            return
        parent = 0
        blocks = self._slot_blocks[slot]
        full = min(num_tokens // BLOCK_SIZE, len(blocks))
        for i in range(full):
            block = blocks[i]
            draft_ok = (i + 1) * BLOCK_SIZE <= draft_tokens
            entry = self._cached.get(block)
            if entry is None:
                key = (parent, tuple(token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
                if key in self._by_key:  # the same content already lives in another block: this one stays private
                    parent = self._cached[self._by_key[key]].content_id
                    continue
                entry = _Cached(key, self._next_content_id, draft_ok)
                self._next_content_id += 1
                self._cached[block] = entry
                self._by_key[key] = block
            elif draft_ok:
                entry.draft_ok = True
            parent = entry.content_id
        if full < len(blocks) and num_tokens > full * BLOCK_SIZE:  # the partly filled block after them
            block = blocks[full]
            held = tuple(token_ids[full * BLOCK_SIZE:num_tokens])
            old = self._partial_of.get(block)
            if old is None or old[0] != parent or len(old[1]) < len(held):
                self._drop_partial(block)
                self._partial_of[block] = (parent, held)
                self._partials.setdefault(parent, {})[block] = held

    def reset_prefix_cache(self) -> None:
        """Forget every registered block (vLLM's reset_prefix_cache); blocks in use stay with their slots."""
        for block in list(self._evictable):
            self._free.append(block)
        self._evictable.clear()
        self._cached.clear()
        self._by_key.clear()
        self._partial_of.clear()
        self._partials.clear()

    def check_consistency(self) -> None:
        """Assert the pool's invariants (tests): every block is free, evictable or referenced, exactly once."""
        refs = [0] * self.num_blocks
        for blocks in self._slot_blocks:
            for b in blocks:
                refs[b] += 1
        assert refs == self._refs, "reference counts disagree with the slots' blocks"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable
        for b in range(self.num_blocks):
            assert (refs[b] > 0) + (b in free) + (b in evictable) == 1, f"block {b} is lost or double-booked"
            assert b not in evictable or self._keeps(b)
