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

The draft's window. A draft model with a bounded context (speculative.draft_model) keeps, for a long
sequence, only its first tokens and a recent window, at positions re-indexed from 0: content that matches no
prefix of the target's. For such a slot (``open_window``) the draft's cache reads and writes blocks private to
the slot, through its own table (``draft_table``, which mirrors ``block_table`` for every other slot); they
are never registered, and while the window is open the draft's content of the shared blocks is not vouched for.

Resident memory. The caches' storage is mapped lazily (engine.kv_cache): a block takes RAM once first written.
So that a pool sized for long contexts (every slot at the model's trained context) costs RAM only for what
sequences hold, ``resident_blocks`` bounds how many distinct blocks the prefix cache may keep written: past it,
a fresh block is taken by evicting the oldest cached one rather than by touching a never-used one. Sequences
themselves always get the blocks they need.
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
                 enable_prefix_caching: bool = True, resident_blocks: int | None = None):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks, self.num_slots, self.blocks_per_slot = num_blocks, num_slots, blocks_per_slot
        self.resident_blocks = num_blocks if resident_blocks is None else max(1, min(resident_blocks, num_blocks))
        # Never-used blocks are taken in increasing order, so the blocks ever written are exactly [0, touched).
        self.touched = 0
        self.enable_prefix_caching = enable_prefix_caching
        # Entries a slot does not hold point at block 0: never read, since readers stay below the lengths given.
        self.block_table = torch.zeros(num_slots, blocks_per_slot, dtype=torch.int64, device=device)
        self.draft_table = torch.zeros_like(self.block_table)  # the draft's cache's: see "The draft's window"
        self._private: list[list[int] | None] = [None] * num_slots  # a slot's window blocks; None: no window
        self._offset = [0] * num_slots  # per open window: real position - re-indexed position past the sinks
        self._slot_blocks: list[list[int]] = [[] for _ in range(num_slots)]
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))   # never used, or released and not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._cached: dict[int, _Cached] = {}             # block -> its registration
        self._by_key: dict[tuple, int] = {}                # (parent content id, tokens) -> block
        self._partial_of: dict[int, tuple[int, tuple]] = {}  # block -> (parent content id, its tokens so far)
        self._partials: dict[int, dict[int, tuple]] = {}     # parent content id -> {block: its tokens so far}
        self._partial_draft: dict[int, int] = {}  # partly filled block -> its tokens the draft holds
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
        # Released blocks go on top of the free list: a top below `touched` was written before. A never-used
        # block is taken only while the written ones stay within resident_blocks, or when nothing is evictable.
        if self._free and (self._free[-1] < self.touched or self.touched < self.resident_blocks
                           or not self._evictable):
            block = self._free.pop()
            self.touched = max(self.touched, block + 1)
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
        self._partial_draft.pop(block, None)
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
            if self._private[slot] is None:
                self.draft_table[slot, len(blocks)] = block
            blocks.append(block)

    # ---- the draft's window ----
    def window(self, slot: int) -> int | None:
        """The offset of the slot's open draft window (real position - re-indexed position past the sinks), or
        None: the draft's cache holds the slot's positions as they are, in the shared blocks."""
        return None if self._private[slot] is None else self._offset[slot]

    def open_window(self, slot: int, offset: int, num_tokens: int) -> bool:
        """Give the slot's draft private blocks for re-indexed positions [0, num_tokens) (kept when a window is
        open already) and set its offset; False, changing nothing, when the pool cannot spare the blocks."""
        have = self._private[slot] or []
        n = -(-num_tokens // BLOCK_SIZE)
        if n > self.blocks_per_slot or n - len(have) > self.num_free_blocks:
            return False
        private = list(have)
        while len(private) < n:
            block = self._take()
            self.draft_table[slot, len(private)] = block
            private.append(block)
        self._private[slot], self._offset[slot] = private, offset
        return True

    def ensure_draft(self, slot: int, num_tokens: int) -> None:
        """Blocks for the draft's positions [0, num_tokens) of ``slot``: its window's, else the shared ones."""
        private = self._private[slot]
        if private is None:
            self.ensure(slot, num_tokens)
        elif -(-num_tokens // BLOCK_SIZE) > len(private):
            if not self.open_window(slot, self._offset[slot], num_tokens):
                raise KVCacheFullError(f"The KV cache has no block left for the draft's window of slot {slot}.")

    def draft_blocks(self, slot: int) -> list[int]:
        """The blocks the draft's cache reads for ``slot``, in position order (do not modify)."""
        private = self._private[slot]
        return self._slot_blocks[slot] if private is None else private

    def _close_window(self, slot: int) -> None:
        private = self._private[slot]
        if private is None:
            return
        for block in private:  # never registered: straight back to the free list
            self._refs[block] -= 1
            self._free.append(block)
        self._private[slot] = None
        blocks = self._slot_blocks[slot]
        if blocks:
            self.draft_table[slot, :len(blocks)] = self.block_table[slot, :len(blocks)]

    def free(self, slot: int) -> None:
        """Drop the slot's references (and its draft window). Registered blocks stay cached until evicted; the
        rest are free."""
        self._close_window(slot)
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

    def partial_in_draft(self, block: int) -> int:
        """How many of the tokens a partly filled block holds (``match_partial``) the draft's cache holds too."""
        return self._partial_draft.get(block, 0)

    def attach(self, slot: int, blocks: list[int]) -> None:
        """Make ``blocks`` (from ``match``) the first blocks of the slot, sharing them (what it held is
        released)."""
        self.free(slot)
        for i, block in enumerate(blocks):
            if self._refs[block] == 0:
                self._evictable.pop(block, None)
            self._refs[block] += 1
            self.block_table[slot, i] = block
            self.draft_table[slot, i] = block
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
        if self._private[slot] is not None:
            draft_tokens = 0  # the draft's content is in its window (flags already set stay: still true)
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
            in_draft = max(0, min(draft_tokens, num_tokens) - full * BLOCK_SIZE)
            if old is None or old[0] != parent or len(old[1]) < len(held):
                self._drop_partial(block)
                self._partial_of[block] = (parent, held)
                self._partials.setdefault(parent, {})[block] = held
                self._partial_draft[block] = in_draft
            elif old[1] == held:
                self._partial_draft[block] = max(self._partial_draft.get(block, 0), in_draft)

    def reset_prefix_cache(self) -> None:
        """Forget every registered block (vLLM's reset_prefix_cache); blocks in use stay with their slots."""
        for block in list(self._evictable):
            self._free.append(block)
        self._evictable.clear()
        self._cached.clear()
        self._by_key.clear()
        self._partial_of.clear()
        self._partials.clear()
        self._partial_draft.clear()

    def check_consistency(self) -> None:
        """Assert the pool's invariants (tests): every block is free, evictable or referenced, exactly once."""
        refs = [0] * self.num_blocks
        for blocks in self._slot_blocks + [p for p in self._private if p is not None]:
            for b in blocks:
                refs[b] += 1
        assert refs == self._refs, "reference counts disagree with the slots' blocks"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable
        for b in range(self.num_blocks):
            assert (refs[b] > 0) + (b in free) + (b in evictable) == 1, f"block {b} is lost or double-booked"
            assert b not in evictable or self._keeps(b)
