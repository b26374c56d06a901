"""On-disk cache of models converted to the CPU kernels' packed weight formats.

Converting a GGUF or safetensors checkpoint to w8a8 / w4a8 / int8 (or fp32 / bf16) costs a dequantize and
requantize pass over every weight. It is done once: the packed tensors are written to one file per (source,
format) under ``<cache dir>/packed/`` (the cache dir honours ``$SPECDECODE_CACHE``), and later loads
memory-map that file, so weight pages are shared with the page cache and read only where touched. The tensors
read whole at load are mapped in huge pages: from the page cache where the kernel keeps the file in large folios,
else moved onto anonymous ones in the background once the engine is built (``huge_pages``).

An entry is a preamble (magic, header length, sha256 of the header), a JSON header (key, model metadata, and per
tensor: dtype, shape, offset, size, checksum) and the tensor data, each tensor 64-byte aligned. The checksum is
the sum of the tensor's bytes taken as int64 words, modulo 2**64: any single changed word changes it. Entries are
written under a temporary name, read back and checked, and only then renamed into place, so a reader sees a
complete entry or none. A truncated or corrupt entry is reported in one line, deleted and rebuilt.

The key covers the source's identity (path, size and mtime of each file), the weight format and dtype,
``LAYOUT_VERSION`` (bump it whenever packing changes what bytes a format holds) and ``KERNEL_LAYOUT`` (what the
C++ kernel expects), plus the byte order and machine.

The directory is bounded in size (``max_bytes``, ``$SPECDECODE_PACKED_CACHE_MAX_GB``): after an entry is
written, the least recently used entries are deleted until the total fits. Use is recorded in each entry's
mtime, set whenever the entry is opened, and entries this process has mapped are never deleted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import platform
import struct
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from specdecode.models import huge_pages

logger = logging.getLogger("specdecode")

LAYOUT_VERSION = 3
# The packed layouts kernels.pack_linear produces and the C++ kernels read (see the kernels package's docstring).
KERNEL_LAYOUT = ("w8a8:g16x4+128,w4a8:g16x8n,u0-15,c8x2-32,fp16x2-256,q4k-raw,w6a8:g16x(4n+2h),u0-63,c8-16,fp16-256,"
                 "q6k-raw,q8_0:g16x4+128,fp16-32xg16,q8_0-raw,int8:row,k8/k32")
_MAGIC = b"SDPACK01"
_PREAMBLE = struct.Struct("<8sQ32s")  # magic, header length, sha256 of the header
_ALIGN = 64
_DATA_ALIGN = 4096
_SUFFIX = ".spk"
_READ_CHUNK = 64 << 20
_ENV = "SPECDECODE_PACKED_CACHE"
_MAX_ENV = "SPECDECODE_PACKED_CACHE_MAX_GB"
# A fixed budget rather than a share of the free space, so that what gets evicted does not depend on what else
# happens to fill the disk. 20 GiB holds the default pair (about 1.6 GB packed) next to two float32 conversions of
# a 1.5B-class model (about 7 GB each), while stopping the directory from growing without end on a laptop disk.
_DEFAULT_MAX_GB = 20.0
_MASK = (1 << 64) - 1


class CorruptEntry(Exception):
    """An entry that exists but cannot be trusted; the message says why."""


@dataclass
class Entry:
    path: Path
    meta: dict                          # what the writer stored under "meta"
    tensors: dict[str, torch.Tensor]    # memory-mapped (copy-on-write) views into the file
    nbytes: int


def enabled() -> bool:
    """False when ``$SPECDECODE_PACKED_CACHE`` is 0 / false / no / off."""
    return os.environ.get(_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def max_bytes() -> int | None:
    """The packed cache's size budget in bytes: ``$SPECDECODE_PACKED_CACHE_MAX_GB`` GiB (2**30 bytes; fractions
    allowed), 20 by default. 0 (or less) means no bound, as ccache's ``max_size = 0`` does: turning the cache off
    is ``SPECDECODE_PACKED_CACHE=0``'s job. An unparsable value is reported and the default used."""
    raw = os.environ.get(_MAX_ENV, "").strip()
    try:
        gb = float(raw) if raw else _DEFAULT_MAX_GB
    except ValueError:
        logger.warning("%s=%r is not a number of GiB; using %g.", _MAX_ENV, raw, _DEFAULT_MAX_GB)
        gb = _DEFAULT_MAX_GB
    return int(gb * 2**30) if 0 < gb < float("inf") else None


def cache_root() -> Path:
    from specdecode.models.default_models import cache_dir

    return cache_dir() / "packed"


def source_identity(source: Path) -> list[list]:
    """(name, size, mtime_ns) of the files a model is read from: the GGUF file, or an HF directory's
    config.json and weight files."""
    source = Path(source).resolve()
    files = [source] if source.is_file() else sorted(
        p for p in source.iterdir() if p.name == "config.json" or p.suffix == ".safetensors"
        or p.name == "model.safetensors.index.json")
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f), st.st_size, st.st_mtime_ns])
    return out


def make_key(source: Path, fmt: str, dtype: str) -> dict:
    return {"layout_version": LAYOUT_VERSION, "kernel_layout": KERNEL_LAYOUT, "byteorder": sys.byteorder,
            "machine": platform.machine(), "format": fmt, "dtype": dtype, "source": source_identity(source)}


def entry_path(source: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    stem = Path(source).resolve().name.removesuffix(".gguf")
    return cache_root() / f"{stem}.{key['format']}.{digest}{_SUFFIX}"


# -------------------------------------------------------------------------------------------------- checksums
def _words_sum(b: torch.Tensor) -> int:
    """Sum of a uint8 tensor's bytes as int64 words (zero-padded to whole words), modulo 2**64. Integer sums
    wrap the same way in any order, so threads and chunking do not change it."""
    if b.numel() % 8:
        b = torch.cat([b, b.new_zeros(8 - b.numel() % 8)])
    return int(b.view(torch.int64).sum()) & _MASK


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _file_words_sum(fd: int, offset: int, nbytes: int) -> int:
    """The same sum read with pread: the pages land in the page cache, not in this process's resident set."""
    total, done = 0, 0
    padded = -(-nbytes // 8) * 8
    buf = torch.empty(min(_READ_CHUNK, padded), dtype=torch.uint8)
    view = memoryview(buf.numpy())
    while done < padded:
        n = min(_READ_CHUNK, padded - done)
        got = os.preadv(fd, [view[:n]], offset + done)
        if got != n:
            raise CorruptEntry(f"the file ends inside tensor data (read {got} of {n} bytes)")
        total = (total + int(buf[:n].view(torch.int64).sum())) & _MASK
        done += n
    return total


def _checksums(mm: mmap.mmap | None, fd: int, placed: list[tuple[dict, torch.dtype, int, int]]) -> Iterable[int | None]:
    """The word sums of ``placed`` tensors (record, dtype, file offset, bytes): read from the mapping, or from
    the file for lazy ones. The kernel extension does all of them in one call without the GIL; torch one tensor
    at a time where it is not at hand. None: the file ends inside the tensor."""
    from specdecode.layers import kernels

    if mm is not None and placed:
        base = torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr()
        sums = kernels.words_sums(base, fd, [(off, nbytes, bool(r["lazy"])) for r, _, off, nbytes in placed])
        if sums is not None:
            return sums
    return (_file_words_sum(fd, off, nbytes) if r["lazy"] else
            int(torch.frombuffer(mm, dtype=torch.int64, count=-(-nbytes // 8), offset=off).sum()) & _MASK
            for r, _, off, nbytes in placed)


# ---------------------------------------------------------------------------------------------------- writing
def write_entry(final: Path, key: dict, meta: dict, tensors: dict[str, torch.Tensor],
                lazy: Iterable[str] = (), before_verify: Callable[[], None] | None = None) -> Entry:
    """Write ``tensors`` (name -> CPU tensor) and ``meta`` (JSON-able) as the entry ``final``, verify it and
    return it opened. ``lazy`` tensors are read sparsely (e.g. an embedding table): their checksum is checked
    through file reads so that checking does not make all of their pages resident. ``before_verify`` runs once
    the bytes are on disk, before they are read back (a caller frees its copy there). Raises OSError on I/O
    failure (nothing is left behind)."""
    lazy = set(lazy)
    records, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        records.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "offset": offset, "nbytes": nbytes, "sum": _words_sum(_as_bytes(t)), "lazy": name in lazy})
        offset += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    header = {"key": key, "meta": meta, "tensors": records, "data_bytes": offset}
    # The header's own length fixes where the data starts, which the header records: iterate to a fixed point.
    data_start = 0
    for _ in range(4):
        header["data_start"] = data_start
        header["file_size"] = data_start + offset
        blob = json.dumps(header, sort_keys=True).encode()
        need = -(-(_PREAMBLE.size + len(blob)) // _DATA_ALIGN) * _DATA_ALIGN
        if need == data_start:
            break
        data_start = need
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_temps(final)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with open(tmp, "wb") as f:
            f.write(_PREAMBLE.pack(_MAGIC, len(blob), hashlib.sha256(blob).digest()))
            f.write(blob)
            for rec, t in zip(records, tensors.values()):
                f.seek(data_start + rec["offset"])
                f.write(_as_bytes(t).numpy().data)
            f.truncate(header["file_size"])
            f.flush()
            os.fsync(f.fileno())
        if before_verify is not None:
            before_verify()
        entry = read_entry(tmp, key)  # read back what is on disk before anyone can see it
        os.replace(tmp, final)
    except CorruptEntry as e:
        _unlink(tmp)
        raise OSError(f"the entry read back differs from what was written ({e})") from None
    except BaseException:
        _unlink(tmp)
        raise
    entry.path = final
    _remove_superseded(final, key)
    _evict_lru(final)
    return entry


def _remove_dead_temps(final: Path) -> None:
    """Temporaries left by writers that died; a live writer's temp (another process) is left alone."""
    for p in final.parent.glob(f"{final.name}.tmp-*"):
        try:
            pid = int(p.name.rsplit(".tmp-", 1)[1].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            _unlink(p)
        except (ValueError, IndexError, PermissionError, OSError):
            pass


def _remove_superseded(final: Path, key: dict) -> None:
    """Entries nothing will read again: those whose source files are gone (e.g. a deleted temporary model), and
    those for the same source and format under another key (the source changed, or an older layout)."""
    src = [s[0] for s in key["source"]]
    for p in final.parent.glob(f"*{_SUFFIX}"):
        if p == final:
            continue
        try:
            other = _read_header(p)[0]["key"]
            other_src = [s[0] for s in other["source"]]
        except (OSError, CorruptEntry, KeyError, TypeError, IndexError):
            continue
        if not all(os.path.exists(s) for s in other_src) or (other_src == src and other.get("format") == key["format"]):
            _unlink(p)


# --------------------------------------------------------------------------------------------------- eviction
class _Mapping(mmap.mmap):
    """A mapping that remembers which file (st_dev, st_ino) it maps. The inode, not the path, because an entry
    is mapped under its temporary name and then renamed."""
    file_id: tuple[int, int]


# The mappings alive in this process. Tensor views hold their mapping, so a mapping leaves this set once no
# model or Entry uses it any more; a plain set of paths ever opened would protect every entry written here.
_live_maps: weakref.WeakSet[_Mapping] = weakref.WeakSet()
_warned_small_budget = False


def _mark_used(path: Path) -> None:
    """Record a use in the entry's mtime (atime is unreliable under noatime / relatime mounts). time.time_ns,
    not the filesystem's coarser clock, so that uses moments apart are still ordered."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:  # e.g. a read-only shared cache: the entry is still usable, eviction just sees it as older
        pass


def _evict_lru(keep: Path) -> None:
    """Delete the least recently used entries until the directory fits in ``max_bytes()``; ``keep`` (just
    written) and entries mapped in this process stay. Entries another process has mapped may go: unlinking a
    mapped file on Linux leaves the mapping valid, and that process converts again on its next start. Only
    ``*.spk`` names are candidates: a live writer's temporary (``*.spk.tmp-<pid>-...``) never is, and is not
    counted either, as its writer runs this pass itself after renaming it."""
    global _warned_small_budget
    budget = max_bytes()
    if budget is None:
        return
    entries: list[tuple[int, str, Path, os.stat_result]] = []
    for p in keep.parent.glob(f"*{_SUFFIX}"):
        try:
            st = p.stat()
        except OSError:  # removed meanwhile by another process
            continue
        entries.append((st.st_mtime_ns, p.name, p, st))
    total = sum(e[3].st_size for e in entries)
    if total <= budget:
        return
    mapped = {m.file_id for m in list(_live_maps)}
    freed, count = 0, 0
    for _, _, p, st in sorted(entries):  # oldest use first
        if total <= budget:
            break
        if p == keep or (st.st_dev, st.st_ino) in mapped:
            continue
        if _unlink(p):
            total, freed, count = total - st.st_size, freed + st.st_size, count + 1
    keep_size = next((e[3].st_size for e in entries if e[2] == keep), 0)
    if keep_size > budget and not _warned_small_budget:
        _warned_small_budget = True
        logger.warning("The packed-weight cache entry %s (%.2f GiB) alone exceeds the cache budget of %.2f GiB "
                       "(%s); keeping it and evicting the other entries not in use.", keep, keep_size / 2**30,
                       budget / 2**30, _MAX_ENV)
    logger.info("Packed-weight cache: evicted %d least recently used entries, freeing %.2f GiB; %.2f GiB of the "
                "%.2f GiB budget in use.", count, freed / 2**30, total / 2**30, budget / 2**30)


# ---------------------------------------------------------------------------------------------------- reading
def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        pre = f.read(_PREAMBLE.size)
        if len(pre) != _PREAMBLE.size:
            raise CorruptEntry(f"it is truncated ({len(pre)} bytes)")
        magic, length, digest = _PREAMBLE.unpack(pre)
        if magic != _MAGIC:
            raise CorruptEntry("it does not start with the packed-entry magic bytes")
        blob = f.read(length)
    if len(blob) != length:
        raise CorruptEntry(f"it is truncated inside its header ({len(blob)} of {length} bytes)")
    if hashlib.sha256(blob).digest() != digest:
        raise CorruptEntry("its header checksum does not match")
    try:
        header = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptEntry(f"its header is not valid JSON ({e})") from None
    return header, _PREAMBLE.size + length


def read_entry(path: Path, key: dict) -> Entry:
    """Open and verify an entry (size, header checksum, every tensor's checksum). Raises FileNotFoundError if
    there is none and CorruptEntry if it cannot be trusted."""
    header, _ = _read_header(path)
    try:
        if header["key"] != key:
            raise CorruptEntry("its key does not match its file name")
        size, want = path.stat().st_size, int(header["file_size"])
        if size != want:
            raise CorruptEntry(f"it is truncated ({size} of {want} bytes)" if size < want
                               else f"it has {size - want} bytes past its end")
        data_start, records = int(header["data_start"]), header["tensors"]
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptEntry(f"its header lacks {e}") from None
    tensors: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f:
        mm = _Mapping(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        if mm is not None:
            st = os.fstat(f.fileno())
            mm.file_id = (st.st_dev, st.st_ino)
            _live_maps.add(mm)
        eager = [r for r in records if not r["lazy"] and r["nbytes"]]
        if eager and hasattr(mm, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
            lo = data_start + min(r["offset"] for r in eager)
            hi = data_start + max(r["offset"] + r["nbytes"] for r in eager)
            lo -= lo % mmap.PAGESIZE
            in_file = hi <= size
            if not (in_file and huge_pages.map_from_page_cache(mm, f.fileno(), lo, hi)):
                mm.madvise(mmap.MADV_WILLNEED, lo, hi - lo)
                if in_file:
                    huge_pages.register(mm, lo, hi)  # moved once the engine is built (huge_pages.start)
        placed = []
        for r in records:
            try:
                dtype = getattr(torch, r["dtype"])
                off, nbytes = data_start + int(r["offset"]), int(r["nbytes"])
                if not isinstance(dtype, torch.dtype) or off + -(-nbytes // 8) * 8 > size:  # sums read whole words
                    raise ValueError
            except (AttributeError, KeyError, TypeError, ValueError):
                raise CorruptEntry(f"its record of tensor {r.get('name')!r} is malformed") from None
            if nbytes == 0:
                tensors[r["name"]] = torch.empty(r["shape"], dtype=dtype)
            else:
                placed.append((r, dtype, off, nbytes))
        for (r, dtype, off, nbytes), got in zip(placed, _checksums(mm, f.fileno(), placed)):
            if got != r["sum"]:
                raise CorruptEntry(f"tensor {r['name']} fails its checksum")
            t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=off).view(dtype)
            tensors[r["name"]] = t.view(r["shape"])
    _mark_used(path)
    return Entry(path, header.get("meta", {}), tensors, size)


def open_entry(path: Path, key: dict) -> Entry | None:
    """The verified entry at ``path``, or None when there is none. A corrupt or partial entry is reported in
    one log line and deleted (the caller then rebuilds it)."""
    try:
        return read_entry(path, key)
    except FileNotFoundError:
        return None
    except CorruptEntry as e:
        logger.warning("Packed-weight cache entry %s is unusable: %s; deleting it and converting again.", path, e)
    except OSError as e:
        logger.warning("Packed-weight cache entry %s could not be read (%s); deleting it and converting again.",
                       path, e.strerror or e)
    _unlink(path)
    return None


def _unlink(path: Path) -> bool:
    """Delete ``path``; True if this call removed it."""
    try:
        path.unlink()
        return True
    except OSError:  # already gone (FileNotFoundError) or not ours to delete
        return False


def describe(entry: Entry) -> dict[str, Any]:
    return {"path": str(entry.path), "bytes": entry.nbytes, "tensors": len(entry.tensors)}
