"""The C++ extension (``csrc/``): its build, load and off switch, and the calls that go straight to it.

The sources are JIT-built as one module with ``torch.utils.cpp_extension.load`` on first use and cached in the
torch extensions directory, or in ``$SPECDECODE_KERNEL_DIR`` if set, under a name derived from the sources, the
flags, torch and the CPU; later loads import the built module directly. If the build fails, one warning is
logged and callers take the pure-torch fallback. ``SPECDECODE_DISABLE_KERNEL=1`` (read at call time) or
``extension.FORCE_FALLBACK = True`` forces that path.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = tuple(sorted(glob.glob(os.path.join(_CSRC, "*.cpp"))))  # one module: every source is compiled into it
_HEADERS = tuple(sorted(glob.glob(os.path.join(_CSRC, "*.h"))))

# Set to True to force the pure-torch fallback (tests / debugging).
FORCE_FALLBACK = False

_lock = threading.Lock()
_ext: Any = None
_build_failed = False


def _cpu_tag() -> str:
    """Short hash of the CPU flags, so a -march=native build is never reused on another CPU."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    import platform
    return hashlib.sha1((platform.machine() + flags).encode()).hexdigest()[:10]


# -fopenmp: at::parallel_for is header-only and only runs in parallel when compiled with OpenMP; the libgomp.so.1
# torch already loaded is reused (same soname), so there is a single runtime. -fvisibility=hidden: the sources share
# their functions with each other only (the module exports PyInit alone), so another build loaded in the same
# process can never stand in for them. The second try is the portable scalar path.
_BASE_CFLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fvisibility=hidden"]
_BUILD_ATTEMPTS = (_BASE_CFLAGS + ["-march=native"], _BASE_CFLAGS)


def _build_root() -> str:
    """``$SPECDECODE_KERNEL_DIR``, else torch's extensions directory (``$TORCH_EXTENSIONS_DIR`` or
    ``torch_extensions`` in the user cache). Not the model cache: tests and users point that elsewhere
    freely, and each new place would mean a fresh compile."""
    env = os.environ.get("SPECDECODE_KERNEL_DIR") or os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "torch_extensions")


def _build_name(cflags: list[str]) -> str:
    """The module name of one build: it changes with the sources (headers included), the flags, torch and the
    CPU, so an existing build of that name is current and can be imported without asking the build system."""
    h = hashlib.sha1()
    for part in (_cpu_tag(), torch.__version__, " ".join(cflags)):
        h.update(part.encode() + b"\0")
    _hash_sources(h)
    return f"specdecode_cpu_linear_{h.hexdigest()[:12]}"


def _hash_sources(h: Any) -> None:
    """Every source and header, name and content, into the hash ``h``."""
    for path in _SOURCES + _HEADERS:
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read() + b"\0")


def _import_built(name: str, directory: str) -> Any:
    """The already built module ``name``, or None. Importing it directly skips cpp_extension (and the
    setuptools import it brings), which is most of a warm load."""
    import importlib.util

    path = os.path.join(directory, name + ".so")
    if not os.path.isfile(path):
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception:  # a build another process is still linking, or a damaged file: let the builder decide
        return None


@contextlib.contextmanager
def _builder_lock(directory: str) -> Iterator[None]:
    """One builder at a time in ``directory`` among our processes: an flock, which the kernel drops when its holder
    dies, however it dies (torch's own ``lock`` file stays behind)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover  (not POSIX: no stale-lock repair)
        yield
        return
    with open(os.path.join(directory, "specdecode.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _clear_stale_lock(directory: str) -> None:
    """Removes torch's build lock from ``directory`` while we hold its builder lock: only a builder killed mid-build
    (whose flock died with it) leaves one then, and cpp_extension.load would wait on it forever (FileBaton.wait)."""
    path = os.path.join(directory, "lock")
    if os.path.exists(path):
        logger.warning("specdecode: removing the stale kernel build lock %s (its build was killed)", path)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _build(name: str, cflags: list[str], directory: str) -> Any:
    """The module ``name`` built in ``directory``, or the one another process of ours built there meanwhile."""
    from torch.utils import cpp_extension

    os.makedirs(directory, exist_ok=True)
    with _builder_lock(directory):
        module = _import_built(name, directory)
        if module is not None:
            return module
        _clear_stale_lock(directory)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cpp_extension.load(name=name, sources=list(_SOURCES), extra_cflags=cflags,
                                      extra_ldflags=["-fopenmp"], build_directory=directory, verbose=False)


def _load_extension() -> Any:
    root = _build_root()
    builds = [(_build_name(cflags), cflags) for cflags in _BUILD_ATTEMPTS]
    for name, _ in builds:  # an earlier build of either (where the native one failed, the portable one)
        module = _import_built(name, os.path.join(root, name))
        if module is not None:
            return module
    last_err: Exception | None = None
    for name, cflags in builds:
        try:
            return _build(name, cflags, os.path.join(root, name))
        except Exception as e:  # compiler missing, ninja missing, bad flags, unwritable directory, ...
            last_err = e
    assert last_err is not None
    raise last_err


def _get_ext() -> Any:
    global _ext, _build_failed
    if _ext is not None or _build_failed:
        return _ext
    with _lock:
        if _ext is None and not _build_failed:
            try:
                _ext = _load_extension()
            except Exception as e:
                _build_failed = True
                logger.warning("specdecode: could not build the row-invariant CPU linear kernel (%s: %s); "
                               "using a slow pure-torch fallback.", type(e).__name__, str(e).strip()[:500])
    return _ext


_ENV_NAME = "SPECDECODE_DISABLE_KERNEL"
try:  # os.environ's backing dict: same data as os.environ.get, ~20x cheaper per call
    _ENV_DATA, _ENV_KEY = os.environ._data, os.environ.encodekey(_ENV_NAME)  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover
    _ENV_DATA, _ENV_KEY = None, _ENV_NAME


def _env_disabled() -> bool:
    if _ENV_DATA is not None:
        v = _ENV_DATA.get(_ENV_KEY)
        if v is None:
            return False
        v = v.decode(errors="replace") if isinstance(v, bytes) else str(v)
    else:  # pragma: no cover
        v = os.environ.get(_ENV_NAME)
        if v is None:
            return False
    return v.strip().lower() not in ("", "0", "false", "no", "off")


def _disabled() -> bool:
    """Fallback forced by ``FORCE_FALLBACK`` or ``SPECDECODE_DISABLE_KERNEL`` (read at every call)."""
    return FORCE_FALLBACK or _env_disabled()


def kernel_available() -> bool:
    """True if the compiled kernel is usable (builds it on first call)."""
    if _disabled():
        return False
    return _get_ext() is not None


def kernel_info() -> dict:
    ext = None if _disabled() else _get_ext()
    return {"available": ext is not None, "avx2": bool(ext.has_avx2()) if ext is not None else False,
            "isa": ext.isa() if ext is not None else None, "amx": amx_active(), "disabled": _disabled()}


@functools.cache
def source_digest() -> str:
    """A short digest of the kernel's C++ sources: pass costs timed with one build say little about another."""
    h = hashlib.sha1()
    _hash_sources(h)
    return h.hexdigest()[:12]


def describe() -> str:
    """One line for reports: which CPU path decode and verification rows run on."""
    info = kernel_info()
    if not info["available"]:
        return "torch fallback (row-invariant kernel " + ("disabled)" if info["disabled"] else "unavailable)")
    return info["isa"] + (", AMX tiles for multi-row w8a8 / w4a8 calls" if info["amx"] else "")


def top_probability(row: torch.Tensor) -> float | None:
    """max(softmax(row)) of a contiguous float32 CPU row by the extension (-1.0 where the row is not finite), or
    None without the extension."""
    ext = None if _disabled() else _get_ext()
    fn = getattr(ext, "top_probability", None)  # absent from builds of older sources (benchmarks/bench_kernel_ab.py)
    if fn is None or row.numel() == 0:
        return None
    return float(fn(row.data_ptr(), row.numel()))


def words_sums(base: int, fd: int, items: list[tuple[int, int, bool]]) -> list[int | None] | None:
    """The packed cache's checksums (models/packed_cache.py) of ``items`` (offset, bytes, read from ``fd``
    instead of the mapping at ``base``) in one call that releases the GIL, or None without the extension."""
    ext = None if _disabled() else _get_ext()
    fn = getattr(ext, "words_sums", None)
    return fn(base, fd, items) if fn is not None else None


def set_amx(enabled: bool) -> bool:
    """Let multi-row integer calls (w8a8 from 3 rows, w4a8 from 7) use AMX tiles; on by default where the CPU
    has them and the OS grants them, ``SPECDECODE_AMX=0`` keeps them off. The results are bitwise the same
    either way, so this only changes speed. Returns whether AMX is now in use."""
    ext = None if _disabled() else _get_ext()
    return bool(ext.amx(int(bool(enabled)))) if ext is not None else False


def amx_active() -> bool:
    """Whether multi-row integer calls currently run on AMX tiles (see set_amx)."""
    ext = None if _disabled() else _get_ext()
    return bool(ext.amx()) if ext is not None else False


