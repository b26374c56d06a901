"""Read a llama.cpp GGUF file as an HF-style config plus lazily dequantized HF-named float32 tensors.

The header is parsed here rather than with ``gguf.GGUFReader``: that reader builds a numpy view per string and
takes ~20 s on a 150k-token vocabulary, while this parser takes well under a second. Dequantization uses
``gguf.quants.dequantize`` for every block type it decodes; the plain value types (I8 ... I64, F64) are cast here.
A file with a tensor of any other type is refused when it is opened, in one line naming the tensor and the type.
The tokenizer in the file's metadata is built by ``gguf_tokenizer``.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from specdecode.models.families import GGUF_ARCHITECTURES

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    **{arch: g.hf_architecture for arch, g in GGUF_ARCHITECTURES.items()},
}

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format (scalars) / numpy dtype (arrays)
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPE = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                12: "<f8"}
_STRING, _ARRAY = 8, 9
_TOKEN_CONTROL = 3
# Control tokens that end a turn in common chat formats; llama.cpp stops on these too.
_END_OF_GENERATION_TEXTS = {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                            "<|end_of_text|>", "</s>"}


class _Corrupt(Exception):
    pass


class _Unsupported(Exception):
    pass


@dataclass
class _TensorRef:
    gguf_name: str
    qtype: int
    dims: tuple[int, ...]          # GGUF order: dims[0] is the innermost (contiguous) axis
    offset: int                    # absolute byte offset in the file
    nbytes: int
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class GGUFModel:
    """An opened GGUF file: HF-style ``config`` and HF-named tensors loaded on demand.

    Besides HF's keys, ``config`` has ``_generation_eos``: every token id that ends generation (EOS, EOT and the
    usual end-of-turn control tokens). ``metadata`` is the raw GGUF key/value metadata.
    """

    path: str
    config: dict
    metadata: dict = field(repr=False, default_factory=dict)
    _refs: dict[str, _TensorRef] = field(repr=False, default_factory=dict)
    _mm: Any = field(repr=False, default=None)

    def tensor_names(self) -> list[str]:
        return list(self._refs)

    def tensor_type(self, hf_name: str) -> str:
        """The GGML storage type of a tensor, e.g. "Q4_K"."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self._ref(hf_name).qtype).name

    def load_tensor(self, hf_name: str) -> torch.Tensor:
        """One tensor, dequantized to float32, in HF's name, shape and layout."""
        ref = self._ref(hf_name)
        if self._mm is None:
            raise ValueError(f"{self.path} has been closed; call read_gguf() again.")
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=ref.nbytes, offset=ref.offset)
        flat = dequantize(raw, ref.qtype, ref.dims[0])
        t = flat.reshape(tuple(reversed(ref.dims)))
        t = t if ref.transform is None else ref.transform(t).contiguous()
        self._release(ref)
        return t

    def row_length(self, hf_name: str) -> int:
        """Values per row (the innermost axis) of a tensor as stored."""
        return self._ref(hf_name).dims[0]

    def raw_rows(self, hf_name: str) -> tuple[str, torch.Tensor]:
        """A 2-D tensor as stored, copied out of the file: ("dense", a float [rows, row_len] tensor) for F32, F16
        and BF16, else (GGML type name, uint8 [rows, row_bytes] blocks). ``load_tensor`` is the same data
        dequantized, and ``dequantize`` decodes any subset of these rows to exactly the same values."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        ref = self._ref(hf_name)
        if self._mm is None:
            raise ValueError(f"{self.path} has been closed; call read_gguf() again.")
        if len(ref.dims) != 2 or ref.transform is not None:
            raise ValueError(f"raw_rows: tensor {ref.gguf_name} is not a plain 2-D table")
        qt = GGMLQuantizationType(ref.qtype)
        block, type_size = GGML_QUANT_SIZES[qt]
        rows, row_bytes = ref.dims[1], ref.dims[0] // block * type_size
        raw = torch.from_numpy(np.frombuffer(self._mm, dtype=np.uint8, count=ref.nbytes, offset=ref.offset).copy())
        self._release(ref)
        dense = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
                 GGMLQuantizationType.BF16: torch.bfloat16}.get(qt)
        if dense is not None:
            return "dense", raw.view(dense).reshape(rows, ref.dims[0])
        return qt.name, raw.reshape(rows, row_bytes)

    def _release(self, ref: _TensorRef) -> None:
        """Drop the tensor's pages from this process (a conversion reads each tensor once; without this the whole
        file would stay resident beside the converted weights). The map stays valid: a view into it (an F32
        tensor) reads the pages back from the file."""
        if hasattr(self._mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            lo = ref.offset - ref.offset % mmap.PAGESIZE
            self._mm.madvise(mmap.MADV_DONTNEED, lo, ref.offset + ref.nbytes - lo)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a tensor still views the map; it is released when that goes away
                pass
            self._mm = None

    def _ref(self, hf_name: str) -> _TensorRef:
        try:
            return self._refs[hf_name]
        except KeyError:
            raise KeyError(f"{self.path} has no tensor {hf_name!r}") from None


# Types that hold plain numbers, one per element: their values, as float32.
_VALUE_TYPES = {"I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8", "F64": "<f8"}


@lru_cache(maxsize=None)
def decodable(qtype: int) -> bool:
    """Whether ``dequantize`` decodes GGML type ``qtype``: a value type, or a block type the installed gguf
    package dequantizes (tried on one block of zeros)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    qt = GGMLQuantizationType(qtype)
    if qt.name in _VALUE_TYPES:
        return True
    block, type_size = GGML_QUANT_SIZES[qt]
    try:
        gguf_dequantize(np.zeros((1, type_size), dtype=np.uint8), qt)
    except NotImplementedError:
        return False
    return True


def dequantize(raw: np.ndarray, qtype: int, row_len: int) -> torch.Tensor:
    """Flat float32 values of a tensor stored as GGML type ``qtype`` in ``raw``, rows of ``row_len`` values."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    qt = GGMLQuantizationType(qtype)
    if qt.name in _VALUE_TYPES:
        return torch.from_numpy(raw.view(_VALUE_TYPES[qt.name]).astype(np.float32)).reshape(-1)
    block, type_size = GGML_QUANT_SIZES[qt]
    arr = gguf_dequantize(raw.reshape(-1, row_len // block * type_size), qt)
    if not arr.flags.writeable or not arr.flags.owndata:
        arr = arr.copy()
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(-1)


def dequantize_rows(rows: torch.Tensor, qtype: int, row_len: int) -> torch.Tensor:
    """float32 ``[n, row_len]``: ``n`` rows as ``GGUFModel.raw_rows`` gives them (uint8 blocks), decoded."""
    return dequantize(rows.numpy(), qtype, row_len).view(-1, row_len)


# ---------------------------------------------------------------------------------------------------- parsing
class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise _Corrupt(f"the header ends early (needs byte {start + n}, file has {self.size})")
        self.pos = start + n
        return start

    def scalar(self, fmt: str):
        start = self.take(struct.calcsize(fmt))
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        try:
            return self.buf[start:start + n].decode("utf-8")
        except UnicodeDecodeError:
            # A few vocabularies hold byte tokens that are not valid UTF-8 on their own.
            return self.buf[start:start + n].decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALAR_FMT:
            return self.scalar(_SCALAR_FMT[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar("<I"), self.scalar("<Q")
            if itype == _STRING:
                if count > self.size:
                    raise _Corrupt(f"an array claims {count} strings")
                return [self.string() for _ in range(count)]
            if itype in _ARRAY_DTYPE:
                dt = np.dtype(_ARRAY_DTYPE[itype])
                start = self.take(count * dt.itemsize)
                return np.frombuffer(self.buf, dtype=dt, count=count, offset=start).tolist()
            if itype == _ARRAY:
                if count > self.size:
                    raise _Corrupt(f"an array claims {count} elements")
                return [self.value(_ARRAY) for _ in range(count)]
            raise _Corrupt(f"unknown array element type {itype}")
        raise _Corrupt(f"unknown metadata value type {vtype}")


def _parse(buf, size: int) -> tuple[dict, list[tuple[str, tuple[int, ...], int, int]], int]:
    """(metadata, [(name, dims, ggml_type, relative_offset)], absolute start of tensor data)."""
    cur = _Cursor(buf, size)
    if size < 4 or bytes(buf[:4]) != _MAGIC:
        raise _Corrupt("not a GGUF file (it does not start with the GGUF magic bytes)")
    cur.take(4)
    version = cur.scalar("<I")
    if version not in (2, 3):
        if version & 0xFFFF == 0:
            raise _Corrupt("it is a big-endian GGUF file, which is not supported")
        raise _Corrupt(f"GGUF version {version} is not supported (only versions 2 and 3)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    if n_tensors > size or n_kv > size:
        raise _Corrupt(f"the header claims {n_tensors} tensors and {n_kv} metadata entries")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar("<I")
        if n_dims > 8:
            raise _Corrupt(f"tensor {name} claims {n_dims} dimensions")
        dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    align = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise _Corrupt(f"general.alignment={align!r} is not a power of two")
    data_start = -(-cur.pos // align) * align
    return meta, infos, data_start


def _tensor_refs(infos, data_start: int, size: int) -> dict[str, _TensorRef]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    refs = {}
    for name, dims, raw_type, rel in infos:
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise _Corrupt(f"tensor {name} has unknown GGML type {raw_type}") from None
        if not dims or dims[0] % block:
            raise _Corrupt(f"tensor {name} has shape {dims}, not a whole number of {qtype.name} blocks")
        nbytes = math.prod(dims) // block * type_size
        offset = data_start + rel
        if offset + nbytes > size:
            raise _Corrupt(f"tensor {name} extends past the end of the file (needs {offset + nbytes} bytes, file "
                           f"has {size}); the file is truncated")
        if name in refs:
            raise _Corrupt(f"tensor {name} appears twice")
        if not decodable(qtype):
            raise _Unsupported(f"tensor {name} is stored as GGML type {qtype.name}, which the installed gguf package "
                               "cannot dequantize; re-quantize the model to a common type (Q4_K_M, Q8_0, F16).")
        refs[name] = _TensorRef(name, int(qtype), dims, offset, nbytes)
    return refs


def open_gguf(path: str | os.PathLike) -> tuple[Path, mmap.mmap, dict, dict[str, _TensorRef]]:
    """(path, read-only map of the file, metadata, GGUF-named tensor references); the caller closes the map.
    Raises ValueError, saying what to do, for a missing, short or malformed file."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"GGUF file {p} does not exist; check the path (or pass an HF model directory).")
    if not p.is_file():
        raise ValueError(f"{p} is not a file; pass a .gguf file (or an HF directory with config.json).")
    size = p.stat().st_size
    if size < 24:
        raise ValueError(f"{p} is not a valid GGUF file: it is only {size} bytes long. Re-download or "
                         "re-export the model.")
    with open(p, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        meta, infos, data_start = _parse(mm, size)
        refs = _tensor_refs(infos, data_start, size)
    except _Unsupported as e:
        mm.close()
        raise ValueError(f"Cannot load {p}: {e}") from None
    except (_Corrupt, struct.error, ValueError, OverflowError, MemoryError) as e:
        mm.close()
        raise ValueError(f"{p} is not a valid GGUF file: {e}. Re-download the file (or re-export it with "
                         "llama.cpp's convert_hf_to_gguf.py); pass an HF directory instead if you have one.") from None
    return p, mm, meta, refs


# ------------------------------------------------------------------------------------------------ HF mapping
_DECODER_RENAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_down.bias": "mlp.down_proj.bias",
    # Mixtral (written as ``llama``): the router, and each projection's experts stacked in one 3-D tensor
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
    "ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight",
    "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight",
    "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight",
}
_DECODER_GLOBALS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                    "output.weight": "lm_head.weight"}
_GPT2_RENAMES = {
    "attn_norm.weight": "ln_1.weight", "attn_norm.bias": "ln_1.bias",
    "attn_qkv.weight": "attn.c_attn.weight", "attn_qkv.bias": "attn.c_attn.bias",
    "attn_output.weight": "attn.c_proj.weight", "attn_output.bias": "attn.c_proj.bias",
    "ffn_norm.weight": "ln_2.weight", "ffn_norm.bias": "ln_2.bias",
    "ffn_up.weight": "mlp.c_fc.weight", "ffn_up.bias": "mlp.c_fc.bias",
    "ffn_down.weight": "mlp.c_proj.weight", "ffn_down.bias": "mlp.c_proj.bias",
}
_GPT2_GLOBALS = {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
                 "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
                 "output.weight": "lm_head.weight"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# RoPE scaling stored as tensors: Llama 3's frequency divisors; Phi-3's LongRoPE factors
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# One expert's projection in files written before llama.cpp stacked the experts (blk.N.ffn_gate.E.weight).
_OLD_EXPERT = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")


def unpermute_rope_rows(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation for the ``llama`` architecture.

    HF rotates the two halves of each head ([x0..x_{d/2-1}] against [x_{d/2}..]); llama.cpp's "normal" rope
    rotates adjacent pairs, so its converter reorders each head's rows from (2, d/2) to (d/2, 2). Works on
    weights [rows, in] and biases [rows].
    """
    rows = t.shape[0]
    return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _map_names(arch: str, refs: dict[str, _TensorRef], heads: int, kv_heads: int) -> dict[str, _TensorRef]:
    if arch == "gpt2":
        globals_, per_block, prefix = _GPT2_GLOBALS, _GPT2_RENAMES, "transformer.h"
    else:
        globals_, per_block, prefix = _DECODER_GLOBALS, _DECODER_RENAMES, "model.layers"
    family = GGUF_ARCHITECTURES.get(arch)
    if family is not None:
        per_block = {**per_block, **family.renames}
    permuted = arch == "llama" or (family is not None and family.rope_permuted)  # Q/K rows in llama.cpp's order
    out: dict[str, _TensorRef] = {}
    unknown = []
    for name, ref in refs.items():
        if name in _ROPE_TENSORS:  # folded into config["rope_scaling"]
            continue
        m = _BLOCK.match(name)
        old_expert = _OLD_EXPERT.match(m.group(2)) if m else None
        if old_expert and f"ffn_{old_expert.group(1)}_exps.weight" in per_block:
            hf = f"{prefix}.{m.group(1)}.{per_block[f'ffn_{old_expert.group(1)}_exps.weight']}"
            out[hf.format(e=int(old_expert.group(2)))] = ref
            continue
        if m and "{e}" in per_block.get(m.group(2), ""):
            template = f"{prefix}.{m.group(1)}.{per_block[m.group(2)]}"
            out.update({template.format(e=e): r for e, r in enumerate(_split_experts(ref))})
            continue
        if m and m.group(2) in per_block:
            hf = f"{prefix}.{m.group(1)}.{per_block[m.group(2)]}"
        elif name in globals_:
            hf = globals_[name]
        else:
            unknown.append(name)
            continue
        if permuted and m and m.group(2).startswith(("attn_q.", "attn_k.")):
            n = heads if m.group(2).startswith("attn_q.") else kv_heads
            ref.transform = lambda t, n=n: unpermute_rope_rows(t, n)
        elif arch == "gpt2" and hf.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            ref.transform = lambda t: t.t()  # HF GPT-2 stores its Conv1D weights as [in, out]
        elif family is not None:
            ref.transform = family.transform(hf)
        out[hf] = ref
    if unknown:
        raise ValueError(f"GGUF tensors {unknown[:5]}{' ...' if len(unknown) > 5 else ''} have no HF equivalent "
                         f"for the {arch!r} architecture; this file is not a plain {arch} model.")
    return out


def _split_experts(ref: _TensorRef) -> list[_TensorRef]:
    """A 3-D stack of experts' weights (GGUF dims: in, out, experts) as one 2-D reference per expert: each expert
    is a contiguous run of whole rows, so its bytes are a slice of the tensor's."""
    if len(ref.dims) != 3:
        raise ValueError(f"tensor {ref.gguf_name} has shape {ref.dims}; expected (in, out, experts)")
    n = ref.dims[2]
    size = ref.nbytes // n
    return [_TensorRef(ref.gguf_name, ref.qtype, ref.dims[:2], ref.offset + e * size, size) for e in range(n)]


def _moe_config(get: Callable[..., Any], refs: dict[str, _TensorRef], layers: int) -> dict:
    """The HF keys of a mixture of experts (Mixtral's and Qwen-MoE's names) from llama.cpp's metadata; the layers
    without a router keep a dense MLP (Qwen-MoE's mlp_only_layers)."""
    experts, used = get("expert_count"), get("expert_used_count")
    if not experts or not used:
        raise ValueError("the file has expert tensors but no expert_count / expert_used_count metadata")
    ff = get("expert_feed_forward_length") or get("feed_forward_length", required=True)
    out = {"num_local_experts": int(experts), "num_experts": int(experts), "num_experts_per_tok": int(used),
           "moe_intermediate_size": int(ff), "decoder_sparse_step": 1,
           "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in refs]}
    shared = get("expert_shared_feed_forward_length")
    if shared:
        out["shared_expert_intermediate_size"] = int(shared)
    return out


def _fit_llama3_scaling(factors: list[float], theta: float, head_dim: int) -> dict | None:
    """Recover HF's llama3 ``rope_scaling`` from llama.cpp's per-frequency ``rope_freqs`` divisors.

    Only (factor, slope, intercept) of the smooth ramp are observable, so low_freq_factor is fixed to 1
    (as in every Llama 3.x release) and the other two values follow from it.
    """
    r = np.asarray(factors, dtype=np.float64)
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if len(r) != len(inv):
        raise ValueError(f"rope_freqs has {len(r)} entries, expected {len(inv)} (head_dim / 2).")
    factor = float(r.max())
    if np.allclose(r, 1.0, rtol=0, atol=1e-6):
        return None
    mid = (r > 1 + 1e-4 * factor) & (r < factor * (1 - 1e-4))
    if mid.sum() < 2:
        raise ValueError("rope_freqs has fewer than two ramp entries, so the llama3 rope scaling it encodes "
                         "cannot be recovered; this GGUF is not supported.")
    smooth = (1.0 / r[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(inv[mid], smooth, 1)
    low = 1.0
    high = low - low / intercept
    old_len = slope * 2 * math.pi * (high - low)
    if abs(old_len - round(old_len)) < 1e-3 * old_len:
        old_len = round(old_len)
    high = round(high, 6)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": old_len}
    if not np.allclose(_llama3_inv_freq(inv, scaling), inv / r, rtol=1e-4, atol=0):
        raise ValueError("rope_freqs in this GGUF does not follow llama3 rope scaling; it is not supported.")
    return scaling


def _llama3_inv_freq(inv: np.ndarray, s: dict) -> np.ndarray:
    """HF's llama3 frequency rescaling, used to check that a fitted ``rope_scaling`` reproduces the file."""
    old, factor = s["original_max_position_embeddings"], s["factor"]
    lo, hi = s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - lo) / (hi - lo)
    ramp = (1 - smooth) * inv / factor + smooth * inv
    return np.where(wavelen > old / lo, inv / factor, np.where(wavelen < old / hi, inv, ramp))


def _end_of_generation_ids(meta: dict) -> list[int]:
    ids = {meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")}
    tokens, types = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.token_type") or []
    for i, (tok, typ) in enumerate(zip(tokens, types)):
        if typ == _TOKEN_CONTROL and tok in _END_OF_GENERATION_TEXTS:
            ids.add(i)
    return sorted(i for i in ids if isinstance(i, int))


def _build_config(arch: str, meta: dict, refs: dict[str, _TensorRef], mm) -> dict:
    def get(key: str, default=None, required: bool = False):
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if required:
            raise ValueError(f"GGUF metadata lacks {full}; the file is incomplete or not a {arch} model.")
        return default

    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) or refs["token_embd.weight"].dims[-1]
    tied = "output.weight" not in refs
    common = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]], "model_type": arch, "vocab_size": int(vocab),
        "tie_word_embeddings": tied, "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"), "torch_dtype": "float32",
    }
    if "tokenizer.ggml.padding_token_id" in meta:
        common["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    eog = _end_of_generation_ids(meta)
    if eog:
        common["_generation_eos"] = eog

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    layers = int(get("block_count", required=True))
    ctx = int(get("context_length", 2048))
    if arch == "gpt2":
        return {**common, "n_embd": hidden, "n_layer": layers, "n_head": heads, "n_positions": ctx,
                "n_ctx": ctx, "n_inner": int(get("feed_forward_length", 4 * hidden)),
                "layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5)),
                "activation_function": "gelu_new"}

    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ValueError("Per-layer KV head counts are not supported.")
    head_dim = int(get("attention.key_length", hidden // heads))
    theta = float(get("rope.freq_base", 10000.0))
    scaling = None
    kind = get("rope.scaling.type")
    factor = get("rope.scaling.factor") or get("rope.scale_linear")
    if kind in (None, "none") and get("rope.scale_linear"):
        kind = "linear"
    if kind not in (None, "none", "linear", "yarn"):
        raise ValueError(f"rope scaling type {kind!r} is not supported (only linear, yarn and llama3).")
    if kind in ("linear", "yarn") and not factor:
        raise ValueError(f"{arch}.rope.scaling.type is {kind!r} but no scaling factor is given.")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(factor)}
    elif kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": int(get("rope.scaling.original_context_length", ctx))}
    if "rope_freqs.weight" in refs:
        scaling = _fit_llama3_scaling(_vector(mm, refs["rope_freqs.weight"]), theta, head_dim)
    if "rope_factors_long.weight" in refs:  # Phi-3's LongRoPE, as convert_hf_to_gguf.py writes it
        scaling = _longrope_scaling(get, refs, mm, ctx)
    config = {
        **common,
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length", 0)),
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim, "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta, "rope_scaling": scaling, "max_position_embeddings": ctx, "hidden_act": "silu",
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in refs,
        "mlp_bias": "blk.0.ffn_up.bias" in refs,
    }
    if arch == "llama":
        config = _llama_window(get, config)
    if any(n.endswith(".ffn_gate_inp.weight") for n in refs):
        config.update(_moe_config(get, refs, layers))
        if arch == "llama":
            config["architectures"] = ["MixtralForCausalLM"]
    elif not config["intermediate_size"]:
        raise ValueError(f"GGUF metadata lacks {arch}.feed_forward_length; the file is incomplete or not a {arch} "
                         "model.")
    return GGUF_ARCHITECTURES[arch].config(get, config) if arch in GGUF_ARCHITECTURES else config


def _vector(mm, ref: _TensorRef) -> list[float]:
    """A small 1-D tensor of the file (RoPE factors), decoded to floats."""
    raw = np.frombuffer(mm, dtype=np.uint8, count=ref.nbytes, offset=ref.offset)
    return dequantize(raw, ref.qtype, ref.dims[0]).tolist()


def _llama_window(get: Callable[..., Any], config: dict) -> dict:
    """llama.cpp writes Mistral and Ministral as ``llama`` and runs them without their window; a file whose metadata
    does carry one (attention.sliding_window, with or without a per-layer sliding_window_pattern) reads back as the
    model that slides: Mistral (every layer) or Ministral (the marked layers)."""
    window = get("attention.sliding_window")
    if not window:
        return config
    pattern = get("attention.sliding_window_pattern")
    if pattern is None:
        return {**config, "architectures": ["MistralForCausalLM"], "sliding_window": int(window)}
    if not isinstance(pattern, list) or len(pattern) != config["num_hidden_layers"]:
        raise ValueError(f"llama.attention.sliding_window_pattern must list one flag per layer, not {pattern!r}.")
    return {**config, "architectures": ["MinistralForCausalLM"], "sliding_window": int(window),
            "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern]}


def _longrope_scaling(get: Callable[..., Any], refs: dict[str, _TensorRef], mm, ctx: int) -> dict:
    """HF's longrope ``rope_parameters`` from rope_factors_long / rope_factors_short and the metadata."""
    if "rope_factors_short.weight" not in refs:
        raise ValueError("the file has rope_factors_long but no rope_factors_short; it is incomplete.")
    factors = {kind: _vector(mm, refs[f"rope_factors_{kind}.weight"]) for kind in ("long", "short")}
    old = int(get("rope.scaling.original_context_length", ctx))
    return {"rope_type": "longrope", "long_factor": factors["long"], "short_factor": factors["short"],
            "original_max_position_embeddings": old, "factor": ctx / old,
            "attention_factor": get("rope.scaling.attn_factor")}


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open a GGUF file: parse its header and build the HF config; tensors are read later, one at a time."""
    p, mm, meta, refs = open_gguf(path)
    try:
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {arch!r} in {p} is not supported; supported: "
                             f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}.")
        if "token_embd.weight" not in refs:
            raise ValueError(f"{p} has no token_embd.weight tensor; it is not a complete {arch} model.")
        try:
            config = _build_config(arch, meta, refs, mm)
            heads = config.get("num_attention_heads") or config.get("n_head")
            hf_refs = _map_names(arch, refs, heads, config.get("num_key_value_heads", heads))
        except ValueError as e:
            raise ValueError(f"Cannot load {p}: {e}") from None
    except Exception:
        mm.close()
        raise
    return GGUFModel(str(p), config, meta, hf_refs, mm)
