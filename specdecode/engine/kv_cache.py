"""The KV cache of one model (target or draft): every layer's keys and values, in one layout and one dtype.

Layout. Positions are grouped in blocks of ``BLOCK_SIZE`` (16). Per layer:
  * keys   ``[num_blocks, kv_heads, head_dim, BLOCK_SIZE]``: transposed inside the block, so the C++ decode
    attention (kernels.LayerStack) reads one block of keys as one contiguous [head_dim, 16] tile and scores
    16 positions per vector operation;
  * values ``[num_blocks, kv_heads, BLOCK_SIZE, head_dim]``: one contiguous row per position, for the weighted
    sum.
``block_table[slot, i]`` names the block that holds positions ``16 i .. 16 i + 15`` of that slot. Every reader
and writer goes through it: the Python attention (``write`` / ``read``) and the C++ stack (which receives the
table). The table and the blocks' lifetimes belong to a ``BlockPool`` (engine/block_pool.py: allocation on
demand, reference counts, shared prefix blocks); the target's and the draft's caches share one pool. Callers
address the cache by (slot, position) and call ``ensure`` before writing new positions.
This is the only copy of the keys: there is no second, differently ordered one.

Dtype. 16-bit on CPU (``"auto"``: float16, whose 10-bit mantissa keeps keys and values closer to fp32 than
bfloat16's 7 bits; the model's activations and every sum stay fp32, and values are widened exactly on load).
``"float32"`` keeps full precision (used by the transformers parity tests). On other devices ``"auto"`` is the
model's dtype. Both the prefill path and decode / verification rows store the same rounding (round to nearest
even) and read the same stored values, so plain and speculative decoding see one cache format.

``"int8"`` (alias ``"q8_0"``, llama.cpp's name for the same idea) stores each key and value row of one
(position, KV head) as D int8 values with one fp32 scale: scale = absmax / 127, q = round(x / scale) (round to
nearest even). The scales of a layer sit in ``[num_blocks, kv_heads, BLOCK_SIZE]`` arrays, one for keys and one
for values, in the same lazily resident map after the int8 blocks. A stored value is read back as
float(q) * scale, one fp32 rounding; the Python path (``write`` / ``read``, any device) and the C++ stack
(KvFmt kKvI8) quantize and dequantize with the same operations in the same order (division, round to nearest
even, one product), so both hold and see the same bytes, and the exactness guarantees above still hold.

Lengths. The cache keeps no lengths. A request's computed length lives in the request and is passed in as the
start position of its next tokens; rolling back rejected drafts is lowering that number, and the next write
overwrites the stale positions. Readers only use positions below the length they are given (a block's
positions past it may be loaded with the block, never used).

Memory. The pool has as many blocks as the KV budget allows (``kv_cache_memory``; by default every slot can
hold max_model_len). On CPU the storage is an anonymous memory map: pages are zero and take no RAM until
written, so the resident size grows with the blocks actually used.
"""
from __future__ import annotations

import mmap

import torch

from specdecode.engine.block_pool import BLOCK_SIZE, BlockPool
from specdecode.layers.kernels import KEY_TILE

assert BLOCK_SIZE == KEY_TILE, "a block must be the C++ attention's key tile"

# vLLM's cache_dtype names plus the usual short forms.
KV_CACHE_DTYPES = {"auto": None, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
                   "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
                   "fp32": torch.float32, "float": torch.float32, "int8": torch.int8, "q8_0": torch.int8}
CPU_AUTO_DTYPE = torch.float16


def check_kv_cache_dtype(name: object) -> str:
    """The name itself if known, else a one-line ValueError naming the valid choices."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        extra = " (fp8 caches are not implemented)" if isinstance(name, str) and name.startswith("fp8") else ""
        raise ValueError(f"kv_cache_dtype must be one of auto, float16, bfloat16, float32, int8 (alias q8_0), "
                         f"got {name!r}{extra}.")
    return name


def resolve_kv_dtype(name: str, device: torch.device | str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype for kv_cache_dtype ``name``: "auto" is 16-bit on CPU and the model dtype elsewhere."""
    dtype = KV_CACHE_DTYPES[check_kv_cache_dtype(name)]
    if dtype is None:
        return CPU_AUTO_DTYPE if torch.device(device).type == "cpu" else model_dtype
    return dtype


# The int8 cache's scales: fp32, so that dequantizing is a single rounding (float(q) * scale) and the scale
# itself is the exactly rounded absmax / 127, with no second narrowing that could differ between paths.
INT8_SCALE_DTYPE = torch.float32
_SCALE_BYTES = 4


def row_bytes(dtype: torch.dtype, head_dim: int) -> int:
    """Bytes one position of one KV head takes for keys (or for values): int8 adds its scale."""
    if dtype is torch.int8:
        return head_dim + _SCALE_BYTES
    return head_dim * torch.empty((), dtype=dtype).element_size()


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) as (int8 values [..., D], fp32 scales [...]): symmetric per row, scale =
    absmax / 127 and q = round(x / scale), round to nearest even. Every step is one IEEE operation in fp32
    (absmax is exact), which csrc/layer_stack.cpp (quantize_row) repeats value for value. An all-zero row
    gets scale 0 and zeros."""
    x = x.float()
    scale = x.abs().amax(-1) / 127
    q = torch.round(x / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(-127, 127)
    return q.to(torch.int8), scale


def _lazy_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose pages become resident only when written (CPU: anonymous mmap, kept alive by the
    tensor; elsewhere plain device memory)."""
    if device.type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype)


class KVCache:
    """Keys and values of every layer of one model, for ``num_slots`` sequences of up to ``max_model_len``, in
    the blocks of ``pool`` (a pool of its own, one max-length sequence per slot, when not given). The layers
    see it as a ``layers.paged_kv.PagedKVCache``."""

    def __init__(self, num_layers: int, num_slots: int, max_model_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, pool: BlockPool | None = None,
                 draft: bool = False):
        if torch.device(device).type == "cpu" and dtype not in set(KV_CACHE_DTYPES.values()) - {None}:
            raise ValueError(f"KV cache dtype {dtype} is not supported on CPU (float16, bfloat16, float32 or int8).")
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers, self.num_slots, self.max_model_len = num_layers, num_slots, max_model_len
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.blocks_per_slot = -(-max_model_len // BLOCK_SIZE)
        if pool is None:
            pool = BlockPool(num_slots * self.blocks_per_slot, num_slots, self.blocks_per_slot, self.device)
        if pool.num_slots != num_slots or pool.blocks_per_slot != self.blocks_per_slot:
            raise ValueError("KVCache: the block pool's slots and blocks per slot must match the cache's")
        self.pool = pool
        self.num_blocks = pool.num_blocks
        block = num_kv_heads * head_dim * BLOCK_SIZE
        # One map for the whole model: [layer, keys | values, block, ...], then (int8) the scales
        # [layer, keys | values, block, kv head, position in block].
        numel = num_layers * 2 * self.num_blocks * block
        self.quantized = dtype is torch.int8
        if self.quantized:
            nscales = num_layers * 2 * self.num_blocks * num_kv_heads * BLOCK_SIZE
            self._storage = _lazy_zeros(numel + nscales * _SCALE_BYTES, torch.uint8, self.device)
            data = self._storage[:numel].view(torch.int8)  # numel is a multiple of 16: the scales stay aligned
            scales = self._storage[numel:].view(INT8_SCALE_DTYPE).view(num_layers, 2, self.num_blocks, num_kv_heads,
                                                                       BLOCK_SIZE)
        else:
            self._storage = data = _lazy_zeros(numel, dtype, self.device)
        pools = data.view(num_layers, 2, self.num_blocks, num_kv_heads, block // num_kv_heads)
        self._keys = [pools[i, 0].view(self.num_blocks, num_kv_heads, head_dim, BLOCK_SIZE) for i in range(num_layers)]
        self._values = [pools[i, 1].view(self.num_blocks, num_kv_heads, BLOCK_SIZE, head_dim)
                        for i in range(num_layers)]
        self._key_scales = [scales[i, 0] for i in range(num_layers)] if self.quantized else None
        self._value_scales = [scales[i, 1] for i in range(num_layers)] if self.quantized else None
        # A draft model's cache follows the pool's draft table: the shared blocks, or a slot's draft window.
        self.draft = draft
        self.block_table = pool.draft_table if draft else pool.block_table

    @classmethod
    def for_model(cls, model: torch.nn.Module, num_slots: int, max_model_len: int, kv_cache_dtype: str,
                  device: torch.device | str, pool: BlockPool | None = None, draft: bool = False) -> "KVCache":
        """A cache shaped for ``model`` (a models.model.CausalLM); ``draft``: a draft model's (see BlockPool)."""
        a = model.args
        dtype = resolve_kv_dtype(kv_cache_dtype, device, model.embed_tokens.weight.dtype)
        return cls(a.num_layers, num_slots, max_model_len, a.num_kv_heads, a.head_dim, dtype, device, pool, draft)

    @staticmethod
    def block_bytes(model: torch.nn.Module, kv_cache_dtype: str, device: torch.device | str) -> int:
        """Bytes one block of ``model``'s cache takes over all layers (keys and values, and int8's scales)."""
        a = model.args
        dtype = resolve_kv_dtype(kv_cache_dtype, device, model.embed_tokens.weight.dtype)
        return 2 * a.num_layers * a.num_kv_heads * BLOCK_SIZE * row_bytes(dtype, a.head_dim)

    def ensure(self, slot: int, num_tokens: int) -> None:
        """Blocks for positions [0, num_tokens) of ``slot`` (BlockPool.ensure, or ensure_draft)."""
        if self.draft:
            self.pool.ensure_draft(slot, num_tokens)
        else:
            self.pool.ensure(slot, num_tokens)

    def copy_positions(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` positions of block ``src`` into block ``dst``, in every layer (a prefix-cache hit
        on part of a block: the block stays its owner's, the copy becomes the new sequence's)."""
        for keys, values in zip(self._keys, self._values):
            keys[dst, :, :, :n] = keys[src, :, :, :n]
            values[dst, :, :n] = values[src, :, :n]
        for scales in (self._key_scales or []) + (self._value_scales or []):
            scales[dst, :, :n] = scales[src, :, :n]

    def repeat(self, slot: int, have: int, end: int) -> None:
        """Fill positions [have, end) of ``slot`` (taking blocks as ``ensure`` does) with copies of its first
        ``have`` positions (whole blocks): a long context to time passes after (calibration.py) without the
        prefill that would compute it. Copies of computed keys, not random ones: passes over random keys ran
        up to 1.7x slower than over a prefill's, and copies cost what the prefill's own keys do."""
        self.ensure(slot, end)
        held = self.pool.draft_blocks(slot) if self.draft else self.pool.blocks(slot)
        src = have // BLOCK_SIZE
        if src == 0:
            raise ValueError("KVCache.repeat needs at least one whole block of computed positions")
        n = -(-end // BLOCK_SIZE)
        ids = torch.tensor(held[:n], device=self.device)
        fill = ids[torch.arange(src, n, device=self.device) % src]
        tables = [t for i in range(self.num_layers) for t in (self._keys[i], self._values[i])]
        tables += [t for scales in ((self._key_scales or []), (self._value_scales or [])) for t in scales]
        for t in tables:
            t[ids[src:]] = t[fill]

    def discard(self, slot: int) -> None:
        """Give the memory of ``slot``'s blocks back to the system (CPU; elsewhere nothing happens): after a
        repeat, its pages would otherwise stay resident until a request reused them. Call it before the
        slot's blocks are freed; they read as zeros afterwards."""
        if self.device.type != "cpu" or self._storage.numel() == 0:
            return
        from specdecode.models.huge_pages import madvise_free
        blocks = sorted(self.pool.draft_blocks(slot) if self.draft else self.pool.blocks(slot))
        if not blocks:
            return
        per_block = self._keys[0][0].numel() * self._keys[0].element_size()  # bytes of one block of one table
        runs, start = [], blocks[0]
        for a, b in zip(blocks, blocks[1:] + [None]):
            if b != a + 1:
                runs.append((start, a + 1))
                start = b
        for table in (t for i in range(self.num_layers) for t in (self._keys[i], self._values[i])):
            for lo, hi in runs:
                first = -(-(table.data_ptr() + lo * per_block) // mmap.PAGESIZE) * mmap.PAGESIZE
                last = (table.data_ptr() + hi * per_block) // mmap.PAGESIZE * mmap.PAGESIZE
                if last > first:
                    madvise_free(first, last - first)

    # ---- sizes ----
    @property
    def bytes_per_token(self) -> int:
        """Bytes one position takes over all layers (keys and values, and int8's scales)."""
        return 2 * self.num_layers * self.num_kv_heads * row_bytes(self.dtype, self.head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes reserved (address space; int8: values and scales); on CPU only the written pages are resident."""
        return self._storage.numel() * self._storage.element_size()

    # ---- storage, for kernels that take raw pointers ----
    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (keys [num_blocks, KV, D, BLOCK_SIZE], values [num_blocks, KV, BLOCK_SIZE, D])."""
        return self._keys[i], self._values[i]

    def scales(self, i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer i's int8 scales (keys', values'), each [num_blocks, KV, BLOCK_SIZE] fp32; None unless int8."""
        if not self.quantized:
            return None
        return self._key_scales[i], self._value_scales[i]

    # ---- addressing ----
    def locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset in block) of each (slot, position), as index tensors for ``write``."""
        return self.block_table[slots, positions // BLOCK_SIZE], positions % BLOCK_SIZE

    def _blocks(self, slot: int, end: int) -> tuple[int, torch.Tensor | None]:
        """(first block, None) when the blocks of positions [0, end) of ``slot`` are consecutive, else (0, the
        block indices)."""
        n = -(-end // BLOCK_SIZE)
        held = (self.pool.draft_blocks(slot) if self.draft else self.pool.blocks(slot))[:n]
        if len(held) < n:
            raise RuntimeError(f"KVCache.read: slot {slot} holds {len(held) * BLOCK_SIZE} positions, {end} asked")
        if held[-1] - held[0] == n - 1 and held == list(range(held[0], held[0] + n)):
            return held[0], None
        return 0, self.block_table[slot, :n]

    # ---- Python attention path ----
    def write(self, layer: int, loc: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([N, KV, D], any float dtype) at the positions ``loc`` (from ``locate``), rounded to the
        cache dtype (round to nearest even; int8: quantize_int8 per position and KV head)."""
        blocks, offsets = loc
        keys, values = self._keys[layer], self._values[layer]
        if self.quantized:
            qk, sk = quantize_int8(k)
            qv, sv = quantize_int8(v)
            keys[blocks, :, :, offsets] = qk
            values[blocks, :, offsets] = qv
            self._key_scales[layer][blocks, :, offsets] = sk
            self._value_scales[layer][blocks, :, offsets] = sv
            return
        keys[blocks, :, :, offsets] = k.to(keys.dtype)
        values[blocks, :, offsets] = v.to(values.dtype)

    def read(self, layer: int, slot: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, end) of ``slot`` as (keys, values), each [KV, end, D] in ``dtype`` (a copy: widening a
        16-bit value to fp32 is exact; an int8 value becomes float(q) * scale in fp32, one rounding, as the C++
        stack computes it, then ``dtype``)."""
        n = -(-end // BLOCK_SIZE)
        first, ids = self._blocks(slot, end)
        keys, values = self._keys[layer], self._values[layer]
        kb = keys[first:first + n] if ids is None else keys[ids]
        vb = values[first:first + n] if ids is None else values[ids]
        KV, D = self.num_kv_heads, self.head_dim
        k = torch.empty(KV, n, BLOCK_SIZE, D, dtype=dtype, device=self.device)
        v = torch.empty(KV, n, BLOCK_SIZE, D, dtype=dtype, device=self.device)
        if self.quantized:
            ks, vs = self._key_scales[layer], self._value_scales[layer]
            ksb = ks[first:first + n] if ids is None else ks[ids]
            vsb = vs[first:first + n] if ids is None else vs[ids]
            # int8 -> fp32 is exact (type promotion widens q before the multiply), so the product is the only
            # rounding; narrowed afterwards where the caller wants another dtype.
            for out, q, sc in ((k, kb.permute(1, 0, 3, 2), ksb), (v, vb.permute(1, 0, 2, 3), vsb)):
                sc = sc.permute(1, 0, 2)[..., None]
                if dtype is torch.float32:
                    torch.mul(q, sc, out=out)
                else:
                    out.copy_(q.float() * sc)
        else:
            k.copy_(kb.permute(1, 0, 3, 2))
            v.copy_(vb.permute(1, 0, 2, 3))
        return k.view(KV, n * BLOCK_SIZE, D)[:, :end], v.view(KV, n * BLOCK_SIZE, D)[:, :end]

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, slots={self.num_slots}, max_model_len={self.max_model_len}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
                f"{self.bytes_per_token} B/token)")
