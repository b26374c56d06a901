"""Calibrated costs, cached on disk.

A calibration times passes for a few seconds; its result only depends on the models' files, the weight
formats, the CPU and kernel path and the thread count, so it is kept per such key (``calibration_key``) in
one JSON file of the cache folder and reused by every later engine start.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

from specdecode.speculative.adaptive.costs import CostModel

logger = logging.getLogger("specdecode")

# Bump the version when what calibrate() measures changes.
_COSTS_VERSION = 4  # 2: batch row counts, and draft passes over several rows; 3-4: load checked
_COSTS_FILE = "adaptive_costs.json"
_MAX_CACHED_COSTS = 64
# A calibration during which other processes used more than this share of our CPUs is used for this run but
# not stored: contention slows the short passes (a draft step) by more than the long ones, so the stored
# ratios would keep speculation off on every later start.
MAX_OTHER_CPU_SHARE = 0.2


def file_identity(path: str | os.PathLike | None) -> list:
    """Name, size and modification time of a model's files (a directory: its weight and config files)."""
    if path is None:
        return []
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.glob("*") if f.suffix in
                                           (".gguf", ".safetensors", ".bin", ".json", ".pt"))
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_key(parts: dict[str, Any]) -> str:
    """A stable digest of what a calibration depends on (``parts``), plus the CPU and the cache version."""
    full = dict(parts, cpu=_cpu_name(), machine=platform.machine(), version=_COSTS_VERSION)
    return hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _costs_to_json(c: CostModel) -> dict:
    return {"verify": {str(ctx): {str(r): s for r, s in t.items()} for ctx, t in c.verify.items()},
            "draft": {str(ctx): s for ctx, s in c.draft.items()},
            "draft_rows": {str(ctx): {str(r): s for r, s in t.items()} for ctx, t in c.draft_rows.items()}}


def _costs_from_json(d: dict) -> CostModel:
    c = CostModel()
    for ctx, table in d["verify"].items():
        for rows, s in table.items():
            if not (isinstance(s, (int, float)) and s > 0):
                raise ValueError("bad cost entry")
            c.add(int(ctx), int(rows), float(s))
    for ctx, s in d["draft"].items():
        if not (isinstance(s, (int, float)) and s > 0):
            raise ValueError("bad cost entry")
        c.add_draft(int(ctx), float(s))
    for ctx, table in d.get("draft_rows", {}).items():
        for rows, s in table.items():
            if not (isinstance(s, (int, float)) and s > 0):
                raise ValueError("bad cost entry")
            c.add_draft(int(ctx), float(s), int(rows))
    if not c.verify:
        raise ValueError("empty cost entry")
    return c


def cached_calibration(key: str, run: Callable[[], CostModel], directory: Path | None,
                       refresh: bool = False, files: list[str] | None = None) -> tuple[CostModel, bool]:
    """The calibration stored under ``key`` in ``directory`` (see calibration_key), else ``run()``'s result,
    stored for the next engine start unless other processes kept the CPUs busy while it ran (see
    MAX_OTHER_CPU_SHARE; ``refresh``: always run, and replace what is stored). Returns (costs,
    whether they came from the cache). ``files``: the model files the costs are for; once one of them is gone
    the entry is dropped first when the cache is full. A missing, corrupt or unwritable cache only costs the
    calibration: it is never an error."""
    path = directory / _COSTS_FILE if directory is not None else None
    entries: dict = {}
    if path is not None and path.is_file():
        try:
            entries = json.loads(path.read_text())
            if not isinstance(entries, dict):
                entries = {}
            if key in entries and not refresh:
                return _costs_from_json(entries[key]), True
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("Ignoring the unreadable speculation cost cache %s (%s); recalibrating.", path, e)
            entries = entries if isinstance(entries, dict) else {}
            entries.pop(key, None)
    costs = run()
    if path is None:
        return costs, False
    share = costs.other_cpu_share
    if share is not None and share > MAX_OTHER_CPU_SHARE:
        logger.warning("Other processes used %.0f%% of this process's CPUs while speculation costs were timed: "
                       "the costs are used for this run but not kept, and a later start calibrates again.",
                       100 * share)
        return costs, False
    entries[key] = dict(_costs_to_json(costs), saved=time.time(), files=list(files or ()))
    if len(entries) > _MAX_CACHED_COSTS:
        # Entries for models whose files are gone (a test's temporary model, say) go first, then the oldest.
        def worth(k: str) -> tuple[bool, float]:
            e = entries[k] if isinstance(entries[k], dict) else {}
            files = e.get("files") if isinstance(e.get("files"), list) else []
            return all(isinstance(f, str) and os.path.exists(f) for f in files), e.get("saved", 0)
        for k in sorted(entries, key=worth)[:len(entries) - _MAX_CACHED_COSTS]:
            entries.pop(k)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("Could not store the speculation costs in %s (%s); the next start calibrates again.",
                       path, e)
    return costs, False
