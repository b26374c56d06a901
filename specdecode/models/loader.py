"""Load a model from an HF directory (config.json + safetensors) or a single GGUF file."""
from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from specdecode.models.model import FAMILIES, CausalLM, family_of
from specdecode.layers.linear import Linear

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


def _gguf_tensors(path: Path) -> tuple[dict, list[str], Callable[[str], torch.Tensor]]:
    from specdecode.models.gguf_loader import read_gguf

    g = read_gguf(path)
    return g.config, g.tensor_names(), g.load_tensor


def load_model(path: Path, dtype: str, device: str, max_model_len: int | None,
               quantization: str | None) -> LoadedModel:
    """max_model_len None means the model's own limit, capped at 4096 to bound the KV cache."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"Model path {path} does not exist; pass an HF directory or a .gguf file.")
    is_gguf = path.is_file()
    config, names, load = (_gguf_tensors if is_gguf else _hf_tensors)(path)
    fam = family_of(config)
    args = FAMILIES[fam].make_args(config, fam)
    target_dtype = resolve_dtype(dtype, config, device)
    if max_model_len is None:
        max_model_len = min(args.max_position_embeddings, 4096)
    elif args.positions == "learned" and max_model_len > args.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the {args.max_position_embeddings} positions "
                         f"this model was trained with; use max_model_len <= {args.max_position_embeddings}.")
    dev = torch.device(device)
    with torch.device("meta"):
        model = CausalLM(args, max_model_len)
    params = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    # Only linear weights take the low-precision dtype on CPU; norms and embeddings stay fp32 there.
    linear_weights = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Linear)}
    # A layer is fused and packed as soon as all its tensors are in, so a quantized model never holds more
    # than about one layer at full precision (checkpoints store tensors layer by layer).
    layer_of = {n: int(n.split(".")[1]) for n in params if n.startswith("layers.")}
    pending = {i: {n for n, j in layer_of.items() if j == i} for i in set(layer_of.values())}
    with _progress(len(names), f"Loading {path.name}") as bar:
        for name in names:
            for ours, t in FAMILIES[fam].map_weight(name, load(name)):
                if ours not in params:
                    continue
                want = tuple(params[ours].shape)
                if tuple(t.shape) != want:
                    raise ValueError(f"Tensor {name} in {path} has shape {tuple(t.shape)}, but the config "
                                     f"implies {want}; config.json and the weights do not belong together.")
                keep = target_dtype if (dev.type != "cpu" or ours in linear_weights) else torch.float32
                loaded[ours] = t.to(device=dev, dtype=keep)
                i = layer_of.get(ours)
                if i is not None and i in pending:
                    pending[i].discard(ours)
                    if not pending[i]:
                        del pending[i]
                        _finish_layer(model, i, loaded, quantization)
            bar.update(1)
    if "lm_head.weight" not in loaded and "embed_tokens.weight" in loaded:  # tied embeddings
        loaded["lm_head.weight"] = loaded["embed_tokens.weight"].to(target_dtype)
    missing = sorted(n for n in params if n not in loaded and (n not in layer_of or layer_of[n] in pending))
    if missing:
        raise ValueError(f"The checkpoint at {path} lacks {len(missing)} tensors the "
                         f"{config.get('architectures')} config needs, e.g. {missing[:4]}.")
    model.load_state_dict(loaded, strict=False, assign=True)  # the layers were assigned as they completed
    if model.rotary is not None:  # buffers were built on the meta device
        fresh = type(model.rotary)(args.head_dim, max(max_model_len, 1), args.rope_theta, args.rope_scaling)
        model.rotary = fresh.to(dev)
    model.eval()
    for m in model.modules():
        if isinstance(m, Linear) and m.packed is None and m.weight is not None:  # the head; layers are done
            m.prepare(quantization)
    return LoadedModel(model, config, path, is_gguf, max_model_len)


def _finish_layer(model: CausalLM, i: int, loaded: dict[str, torch.Tensor], quantization: str | None) -> None:
    """Assign layer i's tensors (taken out of ``loaded``), fuse its projections and pack its linears."""
    prefix = f"layers.{i}."
    state = {n[len(prefix):]: loaded.pop(n) for n in [n for n in loaded if n.startswith(prefix)]}
    layer = model.layers[i]
    layer.load_state_dict(state, strict=True, assign=True)
    layer.fuse_projections()
    for m in layer.modules():
        if isinstance(m, Linear):
            m.prepare(quantization)


def resolve_dtype(dtype: str, config: dict, device: str) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    if device == "cpu":
        return torch.float32  # reduced-precision matmuls are slower than fp32 on most CPUs
    name = str(config.get("torch_dtype") or config.get("dtype") or "float16").replace("torch.", "")
    return _DTYPES.get(name, torch.float16)
