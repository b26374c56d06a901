"""Load a model from an HF directory (config.json + safetensors) or a single GGUF file."""
from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._device import DeviceContext

from specdecode.layers import kernels
from specdecode.layers.embedding import DENSE, PackedEmbedding
from specdecode.layers.linear import Linear, pack_row_slices
from specdecode.layers.rotary import Rotary
from specdecode.models import packed_cache as pc
from specdecode.models.default_models import notice
from specdecode.models.families import FAMILIES, family_of
from specdecode.models.model import CausalLM

logger = logging.getLogger("specdecode")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: CausalLM
    hf_config: dict
    path: Path
    is_gguf: bool
    max_model_len: int


def _progress(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, disable=not sys.stderr.isatty(),
                leave=False)


def _hf_tensors(path: Path) -> tuple[dict, list[str], Callable[[str], torch.Tensor]]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path} has no config.json; an HF model directory needs config.json plus "
                         "*.safetensors weights (or pass a .gguf file).")
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_file} is not valid JSON ({e}); re-download or fix the file.") from None
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({e}).") from None
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"Shards listed in {index.name} are missing from {path}: {missing}.")
    if not files:
        raise ValueError(f"No *.safetensors weights found in {path}. Save the model with "
                         "save_pretrained(..., safe_serialization=True) or pass a .gguf file.")
    from safetensors import SafetensorError, safe_open

    handles, owner = {}, {}
    for f in files:
        try:
            h = safe_open(str(f), framework="pt")
            names = list(h.keys())
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"Corrupt or unreadable safetensors file {f}: {e}. Re-download or re-save "
                             "the weights.") from None
        handles[f] = h
        for n in names:
            owner[n] = f

    def load(name: str) -> torch.Tensor:
        try:
            return handles[owner[name]].get_tensor(name)
        except Exception as e:  # truncated data only shows up when a tensor is read
            raise ValueError(f"Corrupt safetensors file {owner[name]} (tensor {name}): {e}. Re-download or "
                             "re-save the weights.") from None

    return config, list(owner), load


def _open_gguf(path: Path):
    from specdecode.models.gguf_loader import read_gguf

    return read_gguf(path)


def weight_format(dtype: str, device: str, quantization: str | None) -> str:
    """The packed format a CPU model's linears get: the quantization, else fp32 / bf16 from the dtype."""
    if quantization:
        return quantization
    d = _DTYPES.get(dtype, torch.float32)
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(d, "fp32") if device == "cpu" else str(d)


def load_model(path: Path, dtype: str, device: str, max_model_len: int | None,
               quantization: str | None, packed_cache: bool | None = None) -> LoadedModel:
    """max_model_len None means the model's own limit (its trained context, as in vLLM).

    On CPU the converted (packed) weights are cached on disk (models/packed_cache.py) unless ``packed_cache`` is
    False or ``$SPECDECODE_PACKED_CACHE=0``: the first load converts and writes the entry, later loads
    memory-map it."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"Model path {path} does not exist; pass an HF directory or a .gguf file.")
    use_cache = torch.device(device).type == "cpu" and (pc.enabled() if packed_cache is None else packed_cache)
    if not use_cache:
        return _convert(path, dtype, device, max_model_len, quantization)
    # On CPU the dtype never depends on the config ("auto" is float32), so the key needs no header parse.
    fmt = weight_format(dtype if dtype != "auto" else "float32", "cpu", quantization)
    key = pc.make_key(path, fmt, str(resolve_dtype(dtype, {}, "cpu")).removeprefix("torch."))
    final = pc.entry_path(path, key)
    entry = pc.open_entry(final, key)
    if entry is None:
        entry = _convert_once(path, dtype, device, max_model_len, quantization, final, key, fmt)
        if isinstance(entry, LoadedModel):  # the cache could not be written: use the in-memory model
            return entry
    try:
        return _from_entry(entry, path, device, max_model_len)
    except _BadEntry as e:
        logger.warning("Packed-weight cache entry %s is unusable: %s; deleting it and converting again.",
                       entry.path, e)
        pc._unlink(entry.path)
        del entry
        return load_model(path, dtype, device, max_model_len, quantization, packed_cache=False)


def _convert_once(path: Path, dtype: str, device: str, max_model_len: int | None, quantization: str | None,
                  final: Path, key: dict, fmt: str) -> "pc.Entry | LoadedModel":
    """Convert and store under a lock beside the entry: processes that start together (servers, test workers)
    convert a model once, and those that waited map what the first one wrote."""
    from specdecode.models.default_models import _file_lock

    with ExitStack() as stack:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(_file_lock(final.with_name(final.name + ".lock")))
        except (OSError, ValueError):
            pass  # an unwritable cache folder: _convert_and_store says so and goes on without the cache
        entry = pc.open_entry(final, key)
        if entry is not None:
            return entry
        return _convert_and_store(path, dtype, device, max_model_len, quantization, final, key, fmt)


def _convert_and_store(path: Path, dtype: str, device: str, max_model_len: int | None, quantization: str | None,
                       final: Path, key: dict, fmt: str) -> "pc.Entry | LoadedModel":
    notice(f"specdecode: converting {path.name} to {fmt} once; later runs map the result from {final.parent}")
    loaded = _convert(path, dtype, device, max_model_len, quantization, f"Converting {path.name} to {fmt}")
    meta, tensors, lazy = _packed_state(loaded)
    keep = [loaded]
    del loaded

    def drop() -> None:  # the file holds the weights now: free them before it is read back
        keep.clear()
        tensors.clear()
        _release_heap()

    try:
        return pc.write_entry(final, key, meta, tensors, lazy, before_verify=drop)
    except OSError as e:
        logger.warning("Could not write the packed-weight cache entry %s (%s); using the converted model without "
                       "caching it. Set SPECDECODE_CACHE to a writable directory with free space.", final,
                       e.strerror or e)
        return keep[0] if keep else _convert(path, dtype, device, max_model_len, quantization)


def _release_heap() -> None:
    """Hand the memory the conversion freed back to the system: glibc keeps freed heap pages for reuse, and
    a first run would otherwise carry them (hundreds of MB) beside the mapped weights."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class _BadEntry(Exception):
    pass


def _packed_state(loaded: LoadedModel) -> tuple[dict, dict[str, torch.Tensor], set[str]]:
    """Everything a converted CPU model is made of: (metadata, tensors by name, names read sparsely). A tensor
    that several names share (tied embeddings, an fp32 weight that is also its packed copy) is stored once."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    aliases: dict[str, str] = {}

    def add(name: str, t: torch.Tensor) -> str:
        t = t.detach()
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and ident in seen:
            aliases[name] = seen[ident]
        else:
            seen[ident] = name
            tensors[name] = t
        return name

    linears, embedding = {}, None
    for mname, m in loaded.model.named_modules():
        if isinstance(m, Linear):
            p = m.packed
            linears[mname] = {"fmt": p.fmt, "in": p.in_features, "out": p.out_features,
                              "scale": p.scale is not None, "weight": m.weight is not None,
                              "bias": m.bias is not None}
            add(f"{mname}.packed.weight", p.weight)
            if p.scale is not None:
                add(f"{mname}.packed.scale", p.scale)
            if m.weight is not None:
                add(f"{mname}.weight", m.weight)
            if m.bias is not None:
                add(f"{mname}.bias", m.bias)
        elif isinstance(m, PackedEmbedding):
            embedding = {"module": mname, "encoding": m.encoding, "rows": m.num_embeddings,
                         "dim": m.embedding_dim}
            add(f"{mname}.table", m.table)
        elif not isinstance(m, Rotary):  # rotary tables are rebuilt for each max_model_len
            for pname, prm in m._parameters.items():
                if prm is not None:
                    add(f"{mname}.{pname}", prm)
    meta = {"hf_config": loaded.hf_config, "is_gguf": loaded.is_gguf, "linears": linears, "embedding": embedding,
            "aliases": aliases}
    return meta, tensors, {f"{embedding['module']}.table"} if embedding else set()


def _from_entry(entry: "pc.Entry", path: Path, device: str, max_model_len: int | None) -> LoadedModel:
    """The model an entry describes, its tensors memory-mapped (nothing is copied or converted)."""
    meta = entry.meta
    try:
        config, linears, aliases = meta["hf_config"], meta["linears"], meta["aliases"]
        T = dict(entry.tensors)
        T.update({a: T[b] for a, b in aliases.items()})
        fam = family_of(config)
        args = FAMILIES[fam].make_args(config, fam)
        max_model_len = _check_len(args, max_model_len)
        model = _skeleton(args, max_model_len)
        for layer in model.layers:
            layer.fuse_projections()
        for name, rec in linears.items():
            m = model.get_submodule(name)
            w = T.pop(f"{name}.packed.weight")
            scale = T.pop(f"{name}.packed.scale") if rec["scale"] else None
            m.packed = kernels.PackedLinear(rec["fmt"], w, scale, rec["in"], rec["out"])
            m.weight = nn.Parameter(T.pop(f"{name}.weight"), requires_grad=False) if rec["weight"] else None
            m.bias = nn.Parameter(T.pop(f"{name}.bias"), requires_grad=False) if rec["bias"] else None
        emb = meta.get("embedding")
        if emb:
            table = T.pop(f"{emb['module']}.table")
            setattr(model, emb["module"], PackedEmbedding(table, emb["encoding"], emb["rows"], emb["dim"]))
        model.load_state_dict(T, strict=False, assign=True)
        left = [n for n, p in model.named_parameters() if p.is_meta]
        if left:
            raise _BadEntry(f"it lacks {len(left)} tensors, e.g. {left[:3]}")
        for m in model.modules():
            if isinstance(m, Linear) and m.packed is not None:
                m.packed._kernel_args()  # the layout checks the kernel relies on
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise _BadEntry(f"it does not describe a loadable model ({type(e).__name__}: {e})") from None
    _finish_model(model, args, max_model_len, torch.device(device))
    return LoadedModel(model, config, path, bool(meta.get("is_gguf")), max_model_len)


class _MetaSkeleton(DeviceContext):
    """``torch.device("meta")`` that also skips random initialisation: initialising meta tensors does nothing,
    but its meta implementation imports torch's compiler stack (seconds of start-up)."""

    _INITS = {torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.kaiming_uniform_,
              torch.nn.init.trunc_normal_, torch.nn.init.zeros_, torch.nn.init.ones_}

    def __init__(self):
        super().__init__("meta")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._INITS:
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return super().__torch_function__(func, types, args, kwargs)


def _skeleton(args, max_model_len: int) -> CausalLM:
    """The model with every parameter on the meta device (no memory): the loader assigns the real tensors."""
    with _MetaSkeleton():
        return CausalLM(args, max_model_len)


def context_limit(args) -> int:
    """The model's own maximum context, derived as vLLM does: its config's max_position_embeddings (n_positions,
    a GGUF's context_length), times the factor of a linear RoPE scaling."""
    limit = args.max_position_embeddings
    scaling = getattr(args, "rope_scaling", None) or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        limit = int(limit * float(scaling.get("factor", 1.0)))
    return limit


def _check_len(args, max_model_len: int | None) -> int:
    """max_model_len, by default the model's trained context (the KV cache takes RAM only for the positions
    sequences hold: engine.kv_cache, engine.block_pool). A learned position table has no rows beyond
    the context; RoPE models run past it (a draft model may be shorter than the target: its drafts only cost
    speed). The engine refuses a target's max_model_len beyond its context (``check_context``)."""
    if max_model_len is None:
        return context_limit(args)
    if args.positions == "learned" and max_model_len > args.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the {args.max_position_embeddings} positions "
                         f"this model was trained with; use max_model_len <= {args.max_position_embeddings}.")
    return max_model_len


def check_context(args, max_model_len: int) -> None:
    """A target's max_model_len beyond the model's own context is refused, as in vLLM: those positions were
    never trained. SPECDECODE_ALLOW_LONG_MAX_MODEL_LEN=1 (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN) allows it."""
    limit = context_limit(args)
    if max_model_len > limit and os.environ.get("SPECDECODE_ALLOW_LONG_MAX_MODEL_LEN") != "1":
        raise ValueError(f"max_model_len={max_model_len} is larger than the model's maximum context of {limit} "
                         f"tokens (max_position_embeddings / context_length in its config); use max_model_len <= "
                         f"{limit}, or set SPECDECODE_ALLOW_LONG_MAX_MODEL_LEN=1 to run past it.")


def _finish_model(model: CausalLM, args, max_model_len: int, dev: torch.device) -> None:
    # Rotary tables are built on the CPU even in a meta skeleton (layers/rotary.py).
    if model.rotary is not None:
        model.rotary = model.rotary.to(dev)
    if model.local_rotary is not None:
        model.local_rotary = model.local_rotary.to(dev)
    model.eval()


def _mapped_names(fam: str, names: list[str]) -> dict[str, list[str]]:
    """Our parameter names for each checkpoint name (found without reading any tensor)."""
    probe = torch.empty(3, 3, device="meta")
    return {n: [o for o, _ in FAMILIES[fam].map_weight(n, probe)] for n in names}


def _convert(path: Path, dtype: str, device: str, max_model_len: int | None, quantization: str | None,
             desc: str | None = None) -> LoadedModel:
    """Read the checkpoint and convert it (dequantize, fuse, pack): the slow path the cache saves."""
    is_gguf = path.is_file()
    if is_gguf:
        gguf = _open_gguf(path)
        config, names, load = gguf.config, gguf.tensor_names(), gguf.load_tensor
        raw = gguf.raw_rows
    else:
        config, names, load = _hf_tensors(path)
        raw = lambda name: (DENSE, load(name))  # noqa: E731 - the checkpoint's own dtype
    fam = family_of(config)
    args = FAMILIES[fam].make_args(config, fam)
    target_dtype = resolve_dtype(dtype, config, device)
    max_model_len = _check_len(args, max_model_len)
    dev = torch.device(device)
    model = _skeleton(args, max_model_len)
    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    # Only linear weights take the low-precision dtype on CPU; norms and embeddings stay fp32 there.
    linear_weights = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Linear)}
    # A quantized CPU model keeps its embedding table in the checkpoint's encoding (layers/embedding.py).
    packed_embedding = dev.type == "cpu" and (quantization in kernels.QUANTIZED or quantization == MIXED)
    # "mixed": a linear's format follows the GGUF storage types of its checkpoint tensors (_format_of)
    storage: dict[str, str] = {}  # our weight name -> its GGUF storage type
    stored: dict[str, tuple] = {}  # linear weights whose stored Q4_K / Q6_K blocks a format holds exactly
    mapped = _mapped_names(fam, names)
    embed_sources = {n for n, ours in mapped.items() if "embed_tokens.weight" in ours} if packed_embedding else set()
    tied = not any("lm_head.weight" in ours for ours in mapped.values())
    # A layer is fused and packed as soon as all its tensors are in, so a quantized model never holds more
    # than about one layer at full precision (checkpoints store tensors layer by layer); the head and the
    # embedding are packed as soon as they arrive.
    layer_of = {n: int(n.split(".")[1]) for n in params if n.startswith("layers.")}

    def stored_fields(name: str, t: torch.Tensor | None) -> tuple | None:
        """The stored blocks of GGUF tensor ``name`` as the fields of a format that may hold them (_STORED)."""
        if not (is_gguf and dev.type == "cpu" and (quantization == MIXED or (
                quantization == "w4a8" and gguf.tensor_type(name) == "Q4_K"))):
            return None
        return _stored_fields(gguf, name, t)

    def head_from_file(name: str, fmt: str | None) -> bool:
        """Pack the head from GGUF tensor ``name``'s stored rows without ever holding it whole in float32 (150k
        rows take about 1 GB there): from its blocks as stored, else decoded and packed a slice at a time. Only
        for a float32 target, whose head the float path would pack from the same float32 values."""
        return (is_gguf and dev.type == "cpu" and target_dtype == torch.float32 and len(mapped[name]) == 1
                and (_head_from_blocks(model, args, stored_fields(name, None), fmt)
                     or _head_in_slices(model, args, gguf, name, fmt)))

    pending = {i: {n for n, j in layer_of.items() if j == i} for i in set(layer_of.values())}
    done: set[str] = set()
    with _progress(len(names), desc or f"Loading {path.name}") as bar:
        for name in names:
            if is_gguf:
                storage.update(dict.fromkeys(mapped[name], gguf.tensor_type(name)))
            if name in embed_sources:
                encoding, table = raw(name)
                if table.shape[0] != args.vocab_size or (encoding == DENSE and tuple(table.shape) != (
                        args.vocab_size, args.hidden_size)):
                    raise ValueError(f"Tensor {name} in {path} has shape {tuple(table.shape)}, but the config implies "
                                     f"({args.vocab_size}, {args.hidden_size}); config.json and the weights do not "
                                     "belong together.")
                model.embed_tokens = PackedEmbedding(table, encoding, args.vocab_size, args.hidden_size)
                done.add("embed_tokens.weight")
                if tied:  # the head is the same table at full precision, packed
                    fmt = _format_of("lm_head", quantization, storage, "embed_tokens.weight")
                    if not head_from_file(name, fmt):
                        head = [t for o, t in FAMILIES[fam].map_weight(name, load(name)) if o == "embed_tokens.weight"]
                        _pack_head(model, head[0].to(target_dtype), fmt)
                    done.add("lm_head.weight")
                bar.update(1)
                continue
            if mapped[name] == ["lm_head.weight"] and head_from_file(name,
                                                                     _format_of("lm_head", quantization, storage)):
                done.add("lm_head.weight")
                bar.update(1)
                continue
            for ours, t in FAMILIES[fam].map_weight(name, load(name)):
                if ours not in params:
                    continue
                want = tuple(params[ours].shape)
                if tuple(t.shape) != want:
                    raise ValueError(f"Tensor {name} in {path} has shape {tuple(t.shape)}, but the config "
                                     f"implies {want}; config.json and the weights do not belong together.")
                keep = target_dtype if (dev.type != "cpu" or ours in linear_weights) else torch.float32
                t = t.to(device=dev, dtype=keep)
                done.add(ours)
                if ours == "lm_head.weight" and dev.type == "cpu":  # packed now: never held at full precision
                    _pack_head(model, t, _format_of("lm_head", quantization, storage))
                    continue
                loaded[ours] = t
                fields = stored_fields(name, t) if len(mapped[name]) == 1 and ours in linear_weights else None
                if fields is not None:
                    stored[ours] = fields
                i = layer_of.get(ours)
                if i is not None and i in pending:
                    pending[i].discard(ours)
                    if not pending[i]:
                        del pending[i]
                        _finish_layer(model, i, loaded, quantization, storage, stored)
            bar.update(1)
    if is_gguf:
        gguf.close()
    if "lm_head.weight" not in done and "embed_tokens.weight" in loaded:  # tied embeddings
        loaded["lm_head.weight"] = loaded["embed_tokens.weight"].to(target_dtype)
        done.add("lm_head.weight")
    missing = sorted(n for n in params if n not in done and (n not in layer_of or layer_of[n] in pending))
    if missing:
        raise ValueError(f"The checkpoint at {path} lacks {len(missing)} tensors the "
                         f"{config.get('architectures')} config needs, e.g. {missing[:4]}.")
    model.load_state_dict(loaded, strict=False, assign=True)  # the layers were assigned as they completed
    _finish_model(model, args, max_model_len, dev)
    for m in model.modules():
        if isinstance(m, Linear) and m.packed is None and m.weight is not None:  # the head; layers are done
            m.prepare(_format_of("lm_head", quantization, storage, "embed_tokens.weight"))
    return LoadedModel(model, config, path, is_gguf, max_model_len)


def _head_from_blocks(model: CausalLM, args, fields: tuple | None, fmt: str | None) -> bool:
    """Pack the head straight from its stored blocks' fields, if it has them and they suit ``fmt``."""
    if fields is None or tuple(fields.u.shape) != (args.vocab_size, args.hidden_size):
        return False
    packed = _pack_stored(fmt, [fields], args.hidden_size)
    if packed is not None:
        model.lm_head.set_packed(packed)
    return packed is not None


def _head_in_slices(model: CausalLM, args, gguf, name: str, fmt: str | None) -> bool:
    """Pack a quantized GGUF head into ``fmt`` decoding its stored rows a slice at a time, if it is a plain table
    of the config's shape and ``fmt`` a quantized format (the same bytes as packing it whole)."""
    from gguf import GGMLQuantizationType

    from specdecode.models.gguf_loader import dequantize_rows

    if fmt not in kernels.QUANTIZED:
        return False
    try:
        kind, rows = gguf.raw_rows(name)
    except ValueError:  # not a plain 2-D table
        return False
    K = gguf.row_length(name)
    if kind == DENSE or rows.shape[0] != args.vocab_size or K != args.hidden_size:
        return False
    qtype = GGMLQuantizationType[kind]
    model.lm_head.set_packed(pack_row_slices(lambda n0, n1: dequantize_rows(rows[n0:n1], qtype, K), len(rows), K, fmt))
    return True


def _pack_head(model: CausalLM, weight: torch.Tensor, fmt: str | None) -> None:
    model.lm_head.weight = nn.Parameter(weight, requires_grad=False)
    model.lm_head.prepare(fmt)


# GGUF storage types of 4 bits or fewer per weight: under quantization="mixed" their linears become w4a8, whose
# affine blocks hold a Q4_K block as stored; Q6_K ones become w6a8, which holds a Q6_K block as stored; Q8_0 ones
# q8_0, its blocks as stored; other types (Q5_K, F16, ...) and linears that fuse tensors of different types become
# w8a8.
FOUR_BIT_GGUF = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS",
                           "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"})
MIXED = "mixed"
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _parts(module: str) -> list[str]:
    """The weights linear ``module`` (our name) is made of: its own, or its parts' where it fuses several."""
    prefix, _, last = module.rpartition(".")
    return [f"{prefix}.{p}.weight" if prefix else f"{p}.weight" for p in _FUSED.get(last, (last,))]


def _format_of(module: str, quantization: str | None, storage: dict[str, str], source: str | None = None
               ) -> str | None:
    """The weight format of linear ``module`` (our name; a fused one stands for its parts): ``quantization``, or
    under "mixed" the one its parts' GGUF storage types (``storage``; ``source``, else the module's weights) call
    for: w4a8 where all are 4-bit, w6a8 where all are Q6_K, q8_0 where all are Q8_0, else w8a8."""
    if quantization != MIXED:
        return quantization
    kinds = {storage.get(p) for p in ([source] if source else _parts(module))}
    if kinds <= FOUR_BIT_GGUF:
        return "w4a8"
    return {frozenset({"Q6_K"}): "w6a8", frozenset({"Q8_0"}): "q8_0"}.get(frozenset(kinds), "w8a8")


# The GGUF types a format holds exactly as stored: blocks -> fields, fields -> float weights.
_STORED = {"Q4_K": (kernels.q4k_fields, kernels.w4_weights), "Q6_K": (kernels.q6k_fields, kernels.w6_weights),
           "Q8_0": (kernels.q8_0_fields, kernels.q8_weights)}
_PACK = {kernels.W4Fields: ("w4a8", kernels.pack_w4), kernels.W6Fields: ("w6a8", kernels.pack_w6),
         kernels.Q8Fields: ("q8_0", kernels.pack_q8)}


def _stored_fields(gguf, name: str, t: torch.Tensor | None) -> tuple | None:
    """The stored blocks of checkpoint tensor ``name`` as the fields of the format that holds its GGUF type
    (_STORED), if they are exactly ``t`` (our tensor: a name mapping may reorder rows), or with ``t`` None
    exactly the file's own dequantization of them: the linear then holds the file's weights, not a re-fit."""
    from gguf import GGMLQuantizationType

    from specdecode.models.gguf_loader import dequantize_rows

    try:
        kind, blocks = gguf.raw_rows(name)
    except ValueError:  # not a plain 2-D table
        return None
    K = gguf.row_length(name)
    if kind not in _STORED or K % (32 if kind == "Q8_0" else 256) or (t is not None and (t.dim() != 2 or tuple(t.shape) != (blocks.shape[0], K))):
        return None
    fields_of, weights_of = _STORED[kind]
    parts = []
    for n0 in range(0, blocks.shape[0], _CHECK_ROWS):  # in slices: a 150k-row head's float copies cost GBs
        rows = blocks[n0:n0 + _CHECK_ROWS]
        want = t[n0:n0 + _CHECK_ROWS].float() if t is not None else dequantize_rows(rows, GGMLQuantizationType[kind], K)
        f = fields_of(rows, K)
        if not torch.equal(weights_of(f, K), want):
            return None
        parts.append(f)
    return kernels.cat_fields(parts)


_CHECK_ROWS = 4096


def _pack_stored(fmt: str | None, fields: list, K: int) -> "kernels.PackedLinear | None":
    """Format ``fmt`` packed from the stored fields of a linear's parts (in order), if they are that format's."""
    kind = type(fields[0])
    if any(type(f) is not kind for f in fields) or _PACK[kind][0] != fmt:
        return None
    return _PACK[kind][1](kernels.cat_fields(fields), K)


def _finish_layer(model: CausalLM, i: int, loaded: dict[str, torch.Tensor], quantization: str | None,
                  storage: dict[str, str] | None = None, stored: dict | None = None) -> None:
    """Assign layer i's tensors (taken out of ``loaded``), fuse its projections and pack its linears (those
    whose weights are all stored blocks of their format's GGUF type, ``stored``, from those blocks as they
    are)."""
    prefix = f"layers.{i}."
    state = {n[len(prefix):]: loaded.pop(n) for n in [n for n in loaded if n.startswith(prefix)]}
    layer = model.layers[i]
    layer.load_state_dict(state, strict=True, assign=True)
    layer.fuse_projections()
    storage = {} if storage is None else storage
    stored = {} if stored is None else stored
    for name, m in layer.named_modules():
        if isinstance(m, Linear):
            fmt = _format_of(f"{prefix}{name}", quantization, storage)
            parts = _parts(f"{prefix}{name}")
            packed = None
            if m.weight.device.type == "cpu" and all(p in stored for p in parts):
                packed = _pack_stored(fmt, [stored.pop(p) for p in parts], m.in_features)
            if packed is not None:
                m.set_packed(packed)
            else:
                m.prepare(fmt)


def resolve_dtype(dtype: str, config: dict, device: str) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device == "cpu":
        return torch.float32  # reduced-precision matmuls are slower than fp32 on most CPUs
    name = str(config.get("torch_dtype") or config.get("dtype") or "float16").replace("torch.", "")
    return _DTYPES.get(name, torch.float16)
