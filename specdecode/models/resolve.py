"""Turn the user's model argument into a local path: the default pair, a file or directory, or the HF cache."""
from __future__ import annotations

import os
from pathlib import Path

from specdecode.models.default_models import default_model_path


def hf_hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded repos: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def resolve_model(name_or_path: str | os.PathLike | None, role: str = "target") -> Path:
    """Local path of a model: None/""/"default" -> the built-in ``role`` model ("target" or "draft"); an existing
    .gguf file or HF directory -> itself; a repo id like "org/name" -> its snapshot in the local HF cache.
    Never contacts a model hub."""
    if name_or_path is None or str(name_or_path).strip() in ("", "default"):
        return default_model_path(role)
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        return _model_in_dir(path, name)
    cache = hf_hub_cache()
    found = _from_hf_cache(name, cache)
    if found is not None:
        return found
    raise ValueError(f"model {name!r} not found: not a local file or directory, and not in the Hugging Face cache "
                     f"at {cache}; pass a local path (HF directory with config.json, or a .gguf file). No model hub "
                     "is contacted.")


def _model_in_dir(path: Path, name: str) -> Path:
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ValueError(f"Directory {name!r} holds {len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs)}); "
                         "pass the one you want.")
    raise ValueError(f"Directory {name!r} is not a model: it has no config.json and no .gguf file. Pass an HF "
                     "model directory (config.json + weights) or a .gguf file.")


def _from_hf_cache(name: str, cache: Path) -> Path | None:
    parts = name.strip("/").split("/")
    if not 1 <= len(parts) <= 2 or any(p in ("", ".", "..") for p in parts):
        return None
    repo = cache / ("models--" + "--".join(parts))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    candidates: list[Path] = []
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidates.append(snapshots / ref.read_text().strip())
    candidates += sorted((d for d in snapshots.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime,
                         reverse=True)
    for snap in candidates:
        if (snap / "config.json").is_file():
            return snap
    for snap in candidates:  # GGUF-only repos have no config.json
        ggufs = sorted(snap.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    return None
