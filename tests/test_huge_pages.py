"""Weights come from the page cache's huge pages where the kernel keeps files in large folios; elsewhere they are
moved onto huge pages, keep their bytes and their addresses, and the move waits for a quiet engine."""
from __future__ import annotations

import gc
import logging
import time

import torch

from specdecode.models import huge_pages
from specdecode.models import packed_cache as pc

MB = 1 << 20


def _smaps_kb(address: int, field: str) -> int:
    """The kB of ``field`` ('Anonymous', 'FilePmdMapped', ...) of this process's mapping that holds ``address``."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _anonymous_kb(address: int) -> int:
    return _smaps_kb(address, "Anonymous")


def _file_pmd_kb(address: int) -> int:
    return _smaps_kb(address, "FilePmdMapped")


def _moved_kb(entry: pc.Entry) -> int:
    """Anonymous kB (moved pages) of the mapping that holds the middle of entry's 12 MB tensor."""
    return _anonymous_kb(entry.tensors["w"].data_ptr() + 4 * MB)


def _entry(tmp_path, monkeypatch, mb: int = 12, page_cache: bool = False) -> tuple[pc.Entry, torch.Tensor]:
    """A written and read entry with a ``mb`` MB tensor "w". Without ``page_cache``, as on a kernel that keeps
    files in small folios only: the entry's range is left for the mover."""
    if not page_cache:
        monkeypatch.setattr(huge_pages, "map_from_page_cache", lambda *a: False)
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDECODE_PACKED_CACHE", raising=False)
    monkeypatch.delenv("SPECDECODE_NO_HUGE_PAGES", raising=False)
    src = tmp_path / "model.gguf"
    src.write_bytes(b"x")
    w = torch.randn(mb * MB // 4, generator=torch.Generator().manual_seed(0))
    key = {"format": "fp32", "source": [[str(src), 1, 0]]}
    final = pc.cache_root() / "model.fp32.0000.spk"
    pc.write_entry(final, key, {}, {"w": w, "small": torch.arange(10.0)})
    huge_pages._pending.clear()
    return pc.read_entry(final, key), w


def test_a_moved_range_keeps_its_bytes_and_addresses(tmp_path, monkeypatch):
    entry, w = _entry(tmp_path, monkeypatch)
    t = entry.tensors["w"]
    address = t.data_ptr()
    assert huge_pages.usable(), "this test runs on Linux with transparent huge pages available"
    assert len(huge_pages._pending) == 1  # read_entry registered the entry's eager range
    ref, lo, hi = huge_pages._pending.pop()
    mapping = ref()
    assert _anonymous_kb(address + 4 * MB) == 0  # file pages before the move
    before = huge_pages.moved_bytes()
    moved = huge_pages.move(mapping, lo, hi)
    # (>=: another test's engine may be moving its own weights meanwhile; the pages below are this entry's)
    assert moved >= 8 * MB and huge_pages.moved_bytes() - before >= moved
    assert t.data_ptr() == address
    assert torch.equal(t, w)  # the same view, the same bytes, now from anonymous memory
    assert _anonymous_kb(address + 4 * MB) >= moved // 1024
    assert torch.equal(entry.tensors["small"], torch.arange(10.0))


def test_the_move_waits_until_the_engine_is_quiet_and_says_when_it_is_done(tmp_path, monkeypatch, caplog):
    entry, w = _entry(tmp_path, monkeypatch)
    huge_pages._quiet_checks.clear()  # engines of earlier tests
    quiet = {"now": False}
    before = huge_pages.pending_bytes()
    with caplog.at_level(logging.INFO, logger="specdecode"):
        thread = huge_pages.start(lambda: quiet["now"], settle=0.2, machine_quiet=lambda: True)
        assert thread is not None and not huge_pages._pending
        time.sleep(0.6)
        assert _moved_kb(entry) == 0  # busy: still the file's pages
        assert huge_pages.pending_bytes() - before >= 8 * MB  # and a benchmark can see that the move is to come
        assert not any("moved onto huge pages" in m for m in caplog.messages)
        quiet["now"] = True
        thread.join(30)
    assert not thread.is_alive() and _moved_kb(entry) >= 8 * 1024
    assert huge_pages.pending_bytes() == before
    assert any(m.startswith("Weights moved onto huge pages: ") for m in caplog.messages)
    assert torch.equal(entry.tensors["w"], w)
    huge_pages._quiet_checks.clear()


class _Engine:
    def __init__(self):
        self.busy = True

    def quiet(self) -> bool:
        return not self.busy


def test_a_busy_engine_holds_every_move_and_a_gone_one_does_not(tmp_path, monkeypatch):
    huge_pages._quiet_checks.clear()
    busy = _Engine()
    huge_pages.start(busy.quiet)  # nothing pending: it only adds its check
    entry, w = _entry(tmp_path, monkeypatch)
    thread = huge_pages.start(lambda: True, settle=0.1, machine_quiet=lambda: True)
    time.sleep(0.5)
    assert _moved_kb(entry) == 0  # the other engine is busy
    del busy
    gc.collect()
    thread.join(30)
    assert not thread.is_alive() and _moved_kb(entry) >= 8 * 1024
    assert torch.equal(entry.tensors["w"], w)
    huge_pages._quiet_checks.clear()


def test_the_switch_keeps_weights_in_the_file_mapping(tmp_path, monkeypatch):
    entry, _ = _entry(tmp_path, monkeypatch)
    monkeypatch.setenv("SPECDECODE_NO_HUGE_PAGES", "1")
    assert not huge_pages.usable()
    huge_pages._pending.clear()
    pc.read_entry(entry.path, {"format": "fp32", "source": [[str(tmp_path / "model.gguf"), 1, 0]]})
    assert not huge_pages._pending and huge_pages.start(lambda: True) is None


def test_a_mapping_nobody_uses_is_not_kept_for_the_move(tmp_path, monkeypatch):
    entry, _ = _entry(tmp_path, monkeypatch)
    assert len(huge_pages._pending) == 1
    del entry
    gc.collect()
    assert huge_pages.start(lambda: True) is None  # the registered mapping is gone: nothing to move


def test_a_busy_machine_holds_the_move_until_it_is_quiet(tmp_path, monkeypatch):
    """Another process busy on this process's CPUs (a second server in a side-by-side benchmark) holds the
    move as a busy engine of this process does. The default check reads /proc: spinners pinned to every CPU
    this process may use make it say busy (whatever else the machine runs); the move itself waits for it."""
    import os
    import subprocess
    import sys

    cpus = sorted(os.sched_getaffinity(0))
    spin = [subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{c}}})\nwhile True: pass"])
            for c in cpus]
    try:
        probe = huge_pages._MachineQuiet()
        time.sleep(0.3)
        assert not probe()
    finally:
        for p in spin:
            p.kill()
            p.wait()
    entry, w = _entry(tmp_path, monkeypatch)
    huge_pages._quiet_checks.clear()
    machine = {"quiet": False}
    thread = huge_pages.start(lambda: True, settle=0.2, machine_quiet=lambda: machine["quiet"])
    time.sleep(0.8)
    assert _moved_kb(entry) == 0  # this engine is idle, the machine is not
    machine["quiet"] = True
    thread.join(30)
    assert not thread.is_alive() and _moved_kb(entry) >= 8 * 1024
    assert torch.equal(entry.tensors["w"], w)
    huge_pages._quiet_checks.clear()


def _in_small_folios(path, lo: int, hi: int) -> None:
    """Put bytes [lo, hi) of ``path`` in the page cache in small folios, as a writer of small pieces leaves
    them: dropped from the page cache, then written again 4 KiB at a time (the same bytes)."""
    import os

    fd = os.open(path, os.O_RDWR)
    try:
        data = os.pread(fd, hi - lo, lo)
        os.fsync(fd)
        os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
        for at in range(0, len(data), 4096):
            os.pwrite(fd, data[at:at + 4096], lo + at)
        os.fsync(fd)
    finally:
        os.close(fd)


def _compact_memory(retry: bool = False) -> None:
    """Gather free memory into whole 2 MiB blocks where this process may (as root); on a ``retry``, first give
    back the machine's clean page cache too. The page cache takes a large folio only from a free block and
    falls back to small ones rather than wait for reclaim or compaction, so on a machine whose free memory is
    short or in pieces (a long test run, another worker beside it) the reread would come back partly in small
    folios: the case of the test below, not of this one."""
    for knob in (["drop_caches"] if retry else []) + ["compact_memory"]:
        try:
            with open(f"/proc/sys/vm/{knob}", "w") as f:
                f.write("1")
        except OSError:
            pass


def test_a_range_that_comes_back_partly_in_small_folios_goes_to_the_mover(tmp_path, monkeypatch):
    """No free 2 MiB blocks for some of the reread: the page cache path reports failure and the mover gets the
    whole range, so the weights still end on huge pages."""
    entry, w = _entry(tmp_path, monkeypatch, page_cache=True)
    readings = iter([0, huge_pages.HUGE_PAGE])  # before the probe, after it (the probe came back huge) ...
    monkeypatch.setattr(huge_pages, "_file_pmd_bytes", lambda first, last: next(readings, 3 * huge_pages.HUGE_PAGE))
    rereads = []
    monkeypatch.setattr(huge_pages, "_reread", lambda *a: rereads.append(a[2]))
    huge_pages._pending.clear()
    again = pc.read_entry(entry.path, _key(tmp_path))
    assert len(rereads) == 2 and rereads[0] == huge_pages.HUGE_PAGE  # the probe, then the rest, once
    assert len(huge_pages._pending) == 1  # ... but only 3 whole huge pages after it: the mover's
    assert torch.equal(again.tensors["w"], w)


def _key(tmp_path) -> dict:
    return {"format": "fp32", "source": [[str(tmp_path / "model.gguf"), 1, 0]]}


def test_weights_come_from_the_page_caches_huge_pages(tmp_path, monkeypatch):
    """A file in small folios in the page cache: reading it drops the range from the page cache once and reads
    it again in 2 MiB folios, mapped with one entry each, nothing left for the mover. A second reader (another
    process starting) maps the same folios without reading again."""
    rereads = []
    reread = huge_pages._reread
    monkeypatch.setattr(huge_pages, "_reread", lambda *a: (rereads.append(a[2]), reread(*a)))
    entry, w = _entry(tmp_path, monkeypatch, page_cache=True)
    path = entry.path
    assert huge_pages.usable(), "this test runs on Linux with transparent huge pages available"
    seen = []
    for attempt in range(5):  # the page cache falls back to small folios when free memory is short (_compact_memory)
        entry = t = None  # nothing maps the file: its page cache can be dropped
        gc.collect()
        huge_pages._pending.clear()
        _in_small_folios(path, 0, path.stat().st_size)
        _compact_memory(retry=attempt > 0)
        rereads.clear()
        entry = pc.read_entry(path, _key(tmp_path))
        t = entry.tensors["w"]
        seen.append((_file_pmd_kb(t.data_ptr() + 4 * MB), _anonymous_kb(t.data_ptr() + 4 * MB), len(rereads),
                     len(huge_pages._pending)))
        if seen[-1][0] >= 8 * 1024 and seen[-1][1] == 0 and not huge_pages._pending:
            break
    assert seen[-1][0] >= 8 * 1024 and seen[-1][1] == 0 and not huge_pages._pending, \
        f"(FilePmdMapped kB, Anonymous kB, rereads, ranges left to the mover) of each try: {seen}"
    assert torch.equal(t, w) and torch.equal(entry.tensors["small"], torch.arange(10.0))
    assert len(rereads) == 2 and rereads[0] == huge_pages.HUGE_PAGE  # the probe, then the rest
    rereads.clear()
    again = pc.read_entry(path, _key(tmp_path))
    assert not rereads and _file_pmd_kb(again.tensors["w"].data_ptr() + 4 * MB) >= 8 * 1024
    assert torch.equal(again.tensors["w"], w) and not huge_pages._pending


def test_a_kernel_without_large_file_folios_reads_one_piece_again_then_leaves_it_to_the_mover(tmp_path,
                                                                                                monkeypatch):
    entry, w = _entry(tmp_path, monkeypatch, page_cache=True)
    rereads = []
    monkeypatch.setattr(huge_pages, "_file_pmd_bytes", lambda first, last: 0)  # nothing ever maps in 2 MiB
    monkeypatch.setattr(huge_pages, "_reread", lambda *a: rereads.append(a[2]))
    huge_pages._pending.clear()
    again = pc.read_entry(entry.path, _key(tmp_path))
    assert rereads == [huge_pages.HUGE_PAGE]  # the probe alone, not the whole file at every start
    assert len(huge_pages._pending) == 1  # the mover's, as before
    assert torch.equal(again.tensors["w"], w)
