"""Weights in transparent huge pages: mapped from the page cache's huge pages at load where the kernel can, else
moved onto anonymous huge pages in the background, at the same addresses.

The packed weights are mapped from the cache file, and the CPU kernels stream every weight at every decoding
step. With 4 KiB pages each new page costs a TLB walk and restarts the hardware prefetcher, which leaves the
weight stream short of the memory bandwidth (docs/benchmarks.md, session 21).

Where the filesystem keeps files in large folios (ext4, xfs and others on Linux 6.x), a file mapping advised for
huge pages is read into 2 MiB folios and mapped with one entry per 2 MiB, straight from the page cache: no copy,
the pages shared with every process that maps the file, and in place before the first request
(``map_from_page_cache``). A file written in small pieces sits in the page cache in small folios; then its range
is dropped from the page cache once and read again, which gives large ones from then on.

Elsewhere (an older kernel, another filesystem), ``start()`` (called once the engine is built) moves each
registered range in the background, piece by piece, while the engine is quiet (no request, no timing): a piece is
copied into fresh anonymous memory advised for huge pages, and ``mremap`` then puts that memory at the piece's
own address, replacing the file pages in one step. Reading the weights into huge pages at load would make every
start wait for the copy and the kernel's huge-page allocation. The bytes and the addresses the kernels hold stay
the same, so no result can change; a reader that touches the piece meanwhile waits on the page-table lock and
then reads the same bytes from the new pages.

Linux only, and only where transparent huge pages are not set to "never"; ``$SPECDECODE_NO_HUGE_PAGES=1``
switches both off. Anything unexpected (no ``mremap``, an allocation that fails) leaves the rest mapped as it was.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

from specdecode.cpu_share import cpu_times, other_cpu_share

logger = logging.getLogger("specdecode")

HUGE_PAGE = 2 << 20
PIECE = 8 * HUGE_PAGE  # bytes moved per mremap: bounds the extra memory, and how long a request that
# arrives mid-piece waits for it
_ENV = "SPECDECODE_NO_HUGE_PAGES"
_MADV_DONTNEED, _MADV_REMOVE, _MADV_HUGEPAGE, _MADV_POPULATE_READ = 4, 9, 14, 22
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE

_lock = threading.Lock()
# Weak: a mapping registered by a load that no engine starts (a test, a tool) must not stay alive for it.
_pending: list[tuple[weakref.ref, int, int]] = []
_moved = 0  # bytes moved so far in this process
_queued = 0  # bytes handed to a mover thread and not yet moved or given up on (see pending_bytes)


def usable() -> bool:
    """Linux with transparent huge pages not set to "never", unless ``$SPECDECODE_NO_HUGE_PAGES`` is set."""
    if os.environ.get(_ENV, "").strip().lower() not in ("", "0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux") or _libc() is None:
        return False
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


_libc_handle: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL | None:
    global _libc_handle
    if _libc_handle is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_long]
            lib.mremap.restype = ctypes.c_void_p
            lib.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc_handle = lib
        except (OSError, AttributeError):
            return None
    return _libc_handle


def address_of(mapping: mmap.mmap) -> int:
    """The address where ``mapping`` starts."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mapping)) if len(mapping) else 0


def register(mapping: mmap.mmap, lo: int, hi: int) -> None:
    """Bytes [lo, hi) of ``mapping`` (read-only weights) are to move onto huge pages when ``start()`` runs."""
    if hi - lo >= HUGE_PAGE and usable():
        with _lock:
            _pending.append((weakref.ref(mapping), lo, hi))


def _file_pmd_bytes(first: int, last: int) -> int:
    """Bytes of this process's file mappings between addresses first and last mapped in 2 MiB entries (the
    FilePmdMapped of /proc/self/smaps, of the areas that start in that range: advising part of a mapping splits
    it there)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if head[0] in "0123456789abcdef" and "-" in head:
                inside = first <= int(head.split("-", 1)[0], 16) < last
            elif inside and head == "FilePmdMapped:":
                total += int(line.split()[1]) * 1024
    return total


def _populate(at: int, size: int) -> bool:
    """Fault [at, at + size) in from the file (MADV_POPULATE_READ, Linux 5.14+); False where it cannot."""
    lib = _libc()
    return lib is not None and lib.madvise(at, size, _MADV_POPULATE_READ) == 0


def _reread(fd: int, at: int, size: int, offset: int) -> None:
    """Drop [at, at + size) of a read-only private file mapping (its file bytes at ``offset``) from this
    process and from the page cache, then fault it in again: read anew through a mapping advised for huge
    pages, the file comes into the page cache in 2 MiB folios. Pages another process maps stay as they are."""
    _libc().madvise(at, size, _MADV_DONTNEED)
    os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
    _populate(at, size)


def map_from_page_cache(mapping: mmap.mmap, fd: int, lo: int, hi: int) -> bool:
    """Map the whole huge pages inside bytes [lo, hi) of ``mapping`` (a private mapping of file ``fd`` from its
    start, never written) from the page cache's 2 MiB folios, reading them in now; True if (nearly) all of them
    are mapped so. Where the page cache holds the range in small folios, one 2 MiB piece is read again first
    as a probe, and only if that one comes back in a huge page is the whole range (a kernel or filesystem
    without large folios would read the file again at every start for nothing)."""
    if not usable() or not hasattr(os, "posix_fadvise"):
        return False
    base = address_of(mapping)
    first = -(-(base + lo) // HUGE_PAGE) * HUGE_PAGE
    last = (base + hi) // HUGE_PAGE * HUGE_PAGE
    if last <= first or base % HUGE_PAGE:  # a file offset and its address must agree modulo 2 MiB
        return False
    size = last - first
    lib = _libc()
    if lib.madvise(first, size, _MADV_HUGEPAGE) != 0 or not _populate(first, size):
        return False
    enough = 0.9 * size  # the odd piece another process holds mapped in small pages may stay so
    mapped = _file_pmd_bytes(first, last)
    if mapped >= enough:
        return True
    probe = last - HUGE_PAGE
    _reread(fd, probe, HUGE_PAGE, probe - base)
    if _file_pmd_bytes(first, last) < mapped + HUGE_PAGE:
        return False
    _reread(fd, first, size - HUGE_PAGE, first - base)
    return _file_pmd_bytes(first, last) >= enough


def pieces(mapping: mmap.mmap, lo: int, hi: int) -> list[tuple[int, int]]:
    """(address, size) of the pieces that cover the whole huge pages inside bytes [lo, hi) of ``mapping``; the
    few KiB before the first and after the last 2 MiB boundary stay where they are."""
    base = address_of(mapping)
    first = -(-(base + lo) // HUGE_PAGE) * HUGE_PAGE
    last = (base + hi) // HUGE_PAGE * HUGE_PAGE
    return [(at, min(PIECE, last - at)) for at in range(first, last, PIECE)]


def move_piece(at: int, size: int) -> bool:
    """Copy [at, at + size) (2 MiB aligned) into anonymous memory advised for huge pages and mremap it over the
    original, at the same address. False if the memory could not be had (the piece stays as it was)."""
    global _moved
    lib = _libc()
    if lib is None:
        return False
    raw = lib.mmap(None, size + HUGE_PAGE, _PROT_RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if raw is None or raw == ctypes.c_void_p(-1).value:
        return False
    aligned = -(-raw // HUGE_PAGE) * HUGE_PAGE
    lib.madvise(aligned, size, _MADV_HUGEPAGE)
    ctypes.memmove(aligned, at, size)
    if lib.mremap(aligned, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, at) != at:
        lib.munmap(raw, size + HUGE_PAGE)
        return False
    if aligned > raw:  # the slack around the moved part (mremap unmapped the part itself)
        lib.munmap(raw, aligned - raw)
    if raw + HUGE_PAGE > aligned:
        lib.munmap(aligned + size, raw + HUGE_PAGE - aligned)
    with _lock:
        _moved += size
    return True


def move(mapping: mmap.mmap, lo: int, hi: int) -> int:
    """Move the whole huge pages inside bytes [lo, hi) of ``mapping`` now; returns the bytes moved."""
    done = 0
    for at, size in pieces(mapping, lo, hi):
        if not move_piece(at, size):
            break
        done += size
    return done


def madvise_free(at: int, size: int) -> bool:
    """Drop the pages of [at, at + size) (page aligned, anonymous memory): they read as zeros again and take no
    memory until written. MADV_REMOVE for a shared mapping (Python's ``mmap.mmap(-1, n)``: DONTNEED would
    only unmap its pages, which keep their memory and bytes), DONTNEED for a private one. False where
    neither can be done here."""
    lib = _libc()
    return lib is not None and (lib.madvise(at, size, _MADV_REMOVE) == 0 or lib.madvise(at, size, _MADV_DONTNEED) == 0)


def moved_bytes() -> int:
    """Bytes moved onto huge pages so far in this process."""
    return _moved


def pending_bytes() -> int:
    """Bytes a mover thread still has to move (0 once every move has finished or given up): a side-by-side
    benchmark waits for 0, or a server moving its weights meanwhile runs on a core less than its peer."""
    return _queued


_quiet_checks: list[Callable[[], Callable[[], bool] | None]] = []  # each gives its check, or None once gone


def _add_queued(n: int) -> None:
    global _queued
    with _lock:
        _queued += n


def _all_quiet() -> bool:
    with _lock:
        checks = [c() for c in _quiet_checks]
        _quiet_checks[:] = [c for c, f in zip(_quiet_checks, checks) if f is not None]
    return all(f() for f in checks if f is not None)


class _MachineQuiet:
    """Whether, since the last call, other processes left this process's CPUs mostly idle (True where /proc
    cannot tell). A server side by side with another on the same cores (a benchmark) then moves its weights
    only while both are idle: a copy beside the other server's request would slow that request (the copy's
    core, its memory traffic), so one server's move would skew the comparison against the other."""

    def __init__(self, max_share: float = 0.25):
        self.max_share = max_share
        self.last = cpu_times()

    def __call__(self) -> bool:
        now, before = cpu_times(), self.last
        self.last = now
        share = other_cpu_share(before, now)
        return share is None or share <= self.max_share


def start(quiet: Callable[[], bool], settle: float = 0.5,
          machine_quiet: Callable[[], bool] | None = None) -> threading.Thread | None:
    """Move every registered range in a background thread, a piece at a time, each only after every quiet check
    given here (``quiet``, and those of earlier calls while their owners live) has held for ``settle`` seconds:
    a copy running beside a decoding step would slow it more than the pages gain (the step's threads wait on
    each other, and the copy takes a core), and one beside a timed pass would skew its cost. A bound method
    is held weakly. ``machine_quiet`` (default: other processes leave the CPUs mostly idle, _MachineQuiet) must
    hold too. The thread holds each mapping until its range is done."""
    ref = weakref.WeakMethod(quiet) if hasattr(quiet, "__self__") else (lambda: quiet)
    with _lock:
        _quiet_checks.append(ref)
        work = [(m, lo, hi) for ref, lo, hi in _pending if (m := ref()) is not None]
        _pending.clear()
    if not work:
        return None
    others_quiet = machine_quiet or _MachineQuiet()
    total = sum(size for m, lo, hi in work for _, size in pieces(m, lo, hi))
    _add_queued(total)

    def run() -> None:
        since = None  # when the current quiet stretch began (None: not quiet now)
        t0, left = time.monotonic(), total
        # The lowest CPU priority for this thread alone: "quiet" is this process's engine; another process's
        # (a second server on the same cores, as in a side-by-side benchmark) must not lose a core to the copy.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (OSError, AttributeError):
            pass
        try:
            for mapping, lo, hi in work:
                for at, size in pieces(mapping, lo, hi):
                    while True:
                        mine, others = _all_quiet(), others_quiet()  # each call of others_quiet is a reading
                        since = (since or time.monotonic()) if mine and others else None
                        if since is not None and time.monotonic() - since >= settle:
                            break
                        time.sleep(0.05)
                    if not move_piece(at, size):
                        logger.info("specdecode: the rest of the weights stay in small pages (no memory for a "
                                    "huge-page copy)")
                        return
                    left -= size
                    _add_queued(-size)
            logger.info("Weights moved onto huge pages: %.2f GiB in %.1f s", total / 2**30, time.monotonic() - t0)
        except Exception as e:  # the weights stay where they are; only their page size is at stake
            logger.info("specdecode: weights stay in small pages (%s: %s)", type(e).__name__, e)
        finally:
            _add_queued(-left)

    t = threading.Thread(target=run, name="specdecode-huge-pages", daemon=True)
    t.start()
    return t
