"""Assembling the built-in models from their part packages, and resolving model arguments to local paths."""
from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from specdecode.models import default_models as dm
from specdecode.models import resolve as rs
from specdecode.models.default_models import DEFAULT_DRAFT, ModelSpec, cache_dir, default_model_path, ensure_assembled
from specdecode.models.resolve import resolve_model


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _leftovers(directory: Path, name: str) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(name + ".tmp")]


# --------------------------------------------------------------------------------------- fake part packages
@pytest.fixture
def fake_spec(tmp_path, monkeypatch) -> tuple[ModelSpec, bytes]:
    """Three importable part packages holding random bytes, and a spec pinning their concatenation."""
    prefix = f"sdfake{uuid.uuid4().hex[:8]}-part"
    site = tmp_path / "site"
    chunks = [os.urandom(n) for n in (1000, 2500, 7)]
    for i, chunk in enumerate(chunks, 1):
        pkg = site / f"{prefix.replace('-', '_')}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        (pkg / "__init__.py").write_text(
            "import os\n\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part{i:02d}.bin')\n")
    monkeypatch.syspath_prepend(str(site))
    blob = b"".join(chunks)
    spec = ModelSpec("fake model", "fake.gguf", len(blob), hashlib.sha256(blob).hexdigest(), prefix, len(chunks))
    return spec, blob


def test_fake_assembly_marker_and_repairs(fake_spec, tmp_path, monkeypatch):
    spec, blob = fake_spec
    cache = tmp_path / "cache"
    path = ensure_assembled(spec, cache)
    assert path == cache / "fake.gguf" and path.read_bytes() == blob
    assert (cache / "fake.gguf.sha256").is_file() and not _leftovers(cache, "fake.gguf")

    # A trusted marker means no re-hashing and no re-assembly.
    def boom(*a, **k):
        raise AssertionError("should not be called")
    monkeypatch.setattr(dm, "_file_sha256", boom)
    monkeypatch.setattr(dm, "_assemble", boom)
    assert ensure_assembled(spec, cache) == path
    monkeypatch.undo()

    # Same size but different bytes and a new mtime: the marker no longer matches, the hash fails, reassemble.
    before = path.stat().st_mtime_ns
    path.write_bytes(b"x" * len(blob))
    os.utime(path, ns=(before + 10**7, before + 10**7))  # coarse clocks could otherwise keep the old mtime
    assert ensure_assembled(spec, cache).read_bytes() == blob
    # Wrong size: reassemble.
    path.write_bytes(blob[:10])
    assert ensure_assembled(spec, cache).read_bytes() == blob
    # Correct file without a marker (e.g. copied in): verified once, then marked.
    (cache / "fake.gguf.sha256").unlink()
    assert ensure_assembled(spec, cache).read_bytes() == blob
    assert (cache / "fake.gguf.sha256").is_file()
    # Temps left by a killed process are cleaned up on the next assembly.
    (cache / "fake.gguf.tmp-99999").write_bytes(b"partial")
    path.unlink()
    ensure_assembled(spec, cache)
    assert not _leftovers(cache, "fake.gguf")


class _Terminal:
    """A stand-in for a terminal's stderr: collects what is written."""

    def __init__(self):
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        pass


def test_first_assembly_says_so_on_the_terminal(fake_spec, tmp_path, monkeypatch):
    """One line saying what happens (info logging is off, as in the CLI), then the progress bar; nothing later."""
    import logging
    import sys

    spec, _ = fake_spec
    monkeypatch.setattr(logging.getLogger("specdecode"), "level", logging.WARNING)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    ensure_assembled(spec, tmp_path / "c")
    lines = [ln for ln in term.text.replace("\r", "\n").splitlines() if "assembling" in ln]
    assert len(lines) == 1 and "fake model" in lines[0] and str(tmp_path / "c") in lines[0]
    assert "Assembling fake.gguf" in term.text  # the progress bar's label
    term.text = ""
    ensure_assembled(spec, tmp_path / "c")
    assert term.text == ""


def test_fake_checksum_mismatch_leaves_nothing(fake_spec, tmp_path):
    spec, blob = fake_spec
    wrong = ModelSpec(spec.description, spec.filename, spec.size, "0" * 64, spec.package_prefix, spec.num_parts)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="does not match its pinned checksum.*force-reinstall"):
        ensure_assembled(wrong, cache)
    assert not (cache / "fake.gguf").exists() and not _leftovers(cache, "fake.gguf")


def test_fake_wrong_part_sizes(fake_spec, tmp_path):
    spec, blob = fake_spec
    wrong = ModelSpec(spec.description, spec.filename, spec.size + 1, spec.sha256, spec.package_prefix,
                      spec.num_parts)
    with pytest.raises(ValueError, match="add up to .* wrong version"):
        ensure_assembled(wrong, tmp_path / "cache")


def test_missing_part_package(fake_spec, tmp_path):
    spec, _ = fake_spec
    more = ModelSpec(spec.description, spec.filename, spec.size, spec.sha256, spec.package_prefix, 4)
    with pytest.raises(ValueError, match=r"part4 is not installed.*pip install 'specdecode\[models\]'"):
        ensure_assembled(more, tmp_path / "cache")


def test_concurrent_callers_assemble_once(fake_spec, tmp_path, monkeypatch):
    spec, blob = fake_spec
    calls = []
    real = dm._assemble

    def counting(*args):
        calls.append(1)
        time.sleep(0.2)  # widen the window in which the others wait on the lock
        return real(*args)
    monkeypatch.setattr(dm, "_assemble", counting)
    results, errors = [], []

    def run():
        try:
            results.append(ensure_assembled(spec, tmp_path / "cache"))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1
    assert len(set(results)) == 1 and results[0].read_bytes() == blob


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SPECDECODE_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "specdecode"
    with pytest.raises(ValueError, match="Unknown default model 'big'"):
        default_model_path("big")


# ------------------------------------------------------------------------------------------- the real draft
def test_draft_assembly(tmp_path, monkeypatch):
    try:
        dm._part_paths(DEFAULT_DRAFT)
    except ValueError as e:
        pytest.skip(str(e))
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    path = default_model_path("draft")
    assert path == tmp_path / DEFAULT_DRAFT.filename
    assert path.stat().st_size == DEFAULT_DRAFT.size and _sha256(path) == DEFAULT_DRAFT.sha256
    assert not _leftovers(tmp_path, DEFAULT_DRAFT.filename)

    # Found again from its marker: neither hashed nor assembled again (each takes seconds on this file).
    def reread(*_args):
        raise AssertionError("the verified file was read again")
    with monkeypatch.context() as m:
        m.setattr(dm, "_file_sha256", reread)
        m.setattr(dm, "_assemble", reread)
        assert default_model_path("draft") == path

    # A cached file of the wrong size is rebuilt, never used.
    with open(path, "r+b") as f:
        f.truncate(DEFAULT_DRAFT.size // 3)
    assert default_model_path("draft") == path
    assert path.stat().st_size == DEFAULT_DRAFT.size and _sha256(path) == DEFAULT_DRAFT.sha256
    assert not _leftovers(tmp_path, DEFAULT_DRAFT.filename)


# ---------------------------------------------------------------------------------------------- resolution
def test_resolve_default(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(rs, "default_model_path", lambda role: seen.append(role) or tmp_path / role)
    assert resolve_model(None) == tmp_path / "target"
    assert resolve_model("", "draft") == tmp_path / "draft"
    assert resolve_model("default", "draft") == tmp_path / "draft"
    assert seen == ["target", "draft", "draft"]


def test_resolve_local_paths(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(str(f)) == f
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_model(str(hf)) == hf
    one = tmp_path / "one"
    one.mkdir()
    (one / "model-q4.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(one)) == one / "model-q4.gguf"
    (one / "model-q8.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="2 .gguf files"):
        resolve_model(str(one))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json and no .gguf"):
        resolve_model(str(empty))


def _snapshot(hub: Path, repo: str, rev: str, files=("config.json",), age: float = 0.0) -> Path:
    snap = hub / f"models--{repo.replace('/', '--')}" / "snapshots" / rev
    snap.mkdir(parents=True)
    for name in files:
        (snap / name).write_text("{}")
    t = time.time() - age
    os.utime(snap, (t, t))
    return snap


def test_resolve_hf_cache(tmp_path, monkeypatch):
    hub = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.chdir(tmp_path)
    old = _snapshot(hub, "org/model", "aaa", age=100)
    new = _snapshot(hub, "org/model", "bbb")
    assert resolve_model("org/model") == new  # newest snapshot without refs/main
    refs = hub / "models--org--model" / "refs"
    refs.mkdir()
    (refs / "main").write_text("aaa\n")
    assert resolve_model("org/model") == old  # refs/main wins
    gguf_snap = _snapshot(hub, "org/model-GGUF", "ccc", files=("model.Q4_K_M.gguf",))
    assert resolve_model("org/model-GGUF") == gguf_snap / "model.Q4_K_M.gguf"
    _snapshot(hub, "gpt2", "ddd")
    assert resolve_model("gpt2").name == "ddd"

    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    other = _snapshot(tmp_path / "home" / "hub", "org/other", "eee")
    assert resolve_model("org/other") == other


def test_resolve_not_found(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        resolve_model("someorg/nonexistent-model")
    msg = str(e.value)
    assert "model 'someorg/nonexistent-model' not found" in msg and str(tmp_path / "hub") in msg
    assert "No model hub is contacted" in msg and ".gguf" in msg
    with pytest.raises(ValueError, match="not found"):
        resolve_model(str(tmp_path / "missing" / "x.gguf"))


def test_a_symlinked_model_is_assembled_where_it_points(fake_spec, tmp_path):
    """A cache folder may hold a link to another cache's file (the test suite's does, to the user's default
    pair): the file is assembled, locked and marked there, and the linking folder gets nothing but the link."""
    spec, blob = fake_spec
    shared, linking = tmp_path / "shared", tmp_path / "linking"
    shared.mkdir()
    linking.mkdir()
    (linking / spec.filename).symlink_to(shared / spec.filename)
    path = ensure_assembled(spec, linking)
    assert path == shared / spec.filename and path.read_bytes() == blob
    assert (shared / f"{spec.filename}.sha256").is_file()
    assert sorted(p.name for p in linking.iterdir()) == [spec.filename]
    assert ensure_assembled(spec, linking) == path


def test_the_tests_write_nothing_into_the_users_cache_but_the_default_pair(user_cache):
    """conftest.py points $SPECDECODE_CACHE at a temporary folder for the session: packed entries and the rest
    go there, while the default pair's GGUF files are links into the user's cache, where `generate` puts them."""
    from specdecode.models import packed_cache

    session = cache_dir().resolve()
    assert not session.is_relative_to(user_cache.resolve()) and os.environ["SPECDECODE_CACHE"] == str(cache_dir())
    assert packed_cache.cache_root().resolve().is_relative_to(session)
    for spec in dm.DEFAULT_MODELS.values():
        assert (session / spec.filename).readlink() == user_cache / spec.filename
