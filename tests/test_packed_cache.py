"""The packed-weight disk cache: hits are bitwise cold loads, damaged entries are reported once and rebuilt,
concurrent writers never expose a partial entry, and $SPECDECODE_CACHE decides where entries live."""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from specdecode.engine.model_runner import ModelRunner
from specdecode.layers import kernels
from specdecode.layers.embedding import PackedEmbedding
from specdecode.layers.linear import pack_in_chunks
from specdecode.models import loader as loader_mod
from specdecode.models import packed_cache as pc
from specdecode.models.loader import load_model

FORMATS = [("auto", None), ("bfloat16", None), ("auto", "int8"), ("auto", "w8a8"), ("auto", "w4a8")]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDECODE_PACKED_CACHE", raising=False)
    return tmp_path / "cache"


class _Lines(logging.Handler):
    def __init__(self, level: int = logging.WARNING):
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_seen():
    h = _Lines()
    log = logging.getLogger("specdecode")
    log.addHandler(h)
    try:
        yield h.lines
    finally:
        log.removeHandler(h)


def _logits(loaded) -> list[torch.Tensor]:
    """Prefill, three greedy decode steps and a 4-row verification pass: every path a model's weights feed."""
    runner = ModelRunner(loaded, 1, 64, "cpu")
    toks = [3, 17, 42, 5, 9]
    out = [runner.prefill(0, toks)]
    for _ in range(3):
        t = int(out[-1].reshape(-1, out[-1].shape[-1])[-1].argmax())
        toks.append(t)
        out.append(runner.forward_rows([(0, len(toks) - 1, [t])], all_logits=False)[0])
    out.append(runner.forward_rows([(0, 4, toks[4:])], all_logits=True)[0])
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "packed").glob("*.spk"))


def _no_convert(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a cache hit must not convert the checkpoint")
    monkeypatch.setattr(loader_mod, "_convert", boom)


@pytest.mark.parametrize("dtype,quant", FORMATS)
@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied (qwen2) and untied embeddings
def test_hit_is_bitwise_the_cold_load(tiny_models, cache, monkeypatch, family, dtype, quant):
    path = tiny_models[family]
    cold = _logits(load_model(path, dtype, "cpu", None, quant, packed_cache=False))
    assert not _entries(cache)
    first = load_model(path, dtype, "cpu", None, quant)  # converts, writes, then maps the entry
    assert len(_entries(cache)) == 1 and _same(cold, _logits(first))
    _no_convert(monkeypatch)
    hit = load_model(path, dtype, "cpu", None, quant)
    assert _same(cold, _logits(hit))
    lin = hit.model.layers[0].qkv_proj.packed
    assert lin.fmt == loader_mod.weight_format(dtype, "cpu", quant)
    assert not lin.weight.untyped_storage().resizable()  # a view of the mapped file, not a copy
    assert not list((cache / "packed").glob("*.tmp-*"))


def test_an_entry_that_reads_back_wrong_is_not_kept_and_the_model_still_loads(tiny_models, cache, monkeypatch,
                                                                              warnings_seen):
    """The converted weights are freed once written (before the read-back, so a first run never holds both);
    if the read-back then fails, the entry is deleted and the checkpoint converted again, uncached."""
    path = tiny_models["qwen2"]
    cold = _logits(load_model(path, "auto", "cpu", None, "w8a8", packed_cache=False))
    real = pc.read_entry

    def bad(p, key):
        if ".tmp-" in p.name:
            raise pc.CorruptEntry("a flipped bit")
        return real(p, key)

    monkeypatch.setattr(pc, "read_entry", bad)
    loaded = load_model(path, "auto", "cpu", None, "w8a8")
    assert _same(cold, _logits(loaded))
    assert not _entries(cache) and not list((cache / "packed").glob("*.tmp-*"))
    assert any("read back differs" in m for m in warnings_seen)


def test_quantized_embedding_keeps_the_checkpoint_encoding(tiny_models, cache):
    """A quantized model looks its embedding rows up in the stored table; they are the dense rows bitwise."""
    path = tiny_models["llama"]
    m = load_model(path, "auto", "cpu", None, "w8a8").model
    assert isinstance(m.embed_tokens, PackedEmbedding) and m.embed_tokens.table.dtype == torch.float32
    from safetensors.torch import load_file

    dense = load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"].float()
    ids = torch.tensor([[0, 5, 511], [7, 7, 1]])
    assert torch.equal(m.embed_tokens(ids), torch.nn.functional.embedding(ids, dense))
    with pytest.raises(IndexError):
        m.embed_tokens(torch.tensor([512]))


@pytest.mark.parametrize("damage", ["truncate", "flip-data", "flip-header", "empty"])
def test_damaged_entry_is_reported_once_and_rebuilt(tiny_models, cache, monkeypatch, warnings_seen, damage):
    path = tiny_models["llama"]
    cold = _logits(load_model(path, "auto", "cpu", None, "w8a8", packed_cache=False))
    load_model(path, "auto", "cpu", None, "w8a8")
    (entry,) = _entries(cache)
    size = entry.stat().st_size
    header, _ = pc._read_header(entry)
    if damage == "truncate":
        os.truncate(entry, size - 1000)
    elif damage == "empty":
        os.truncate(entry, 0)
    else:
        if damage == "flip-data":  # the middle of a layer weight
            rec = next(r for r in header["tensors"] if r["name"] == "layers.1.gate_up_proj.packed.weight")
            at = header["data_start"] + rec["offset"] + rec["nbytes"] // 2
        else:
            at = 200
        with open(entry, "r+b") as f:
            f.seek(at)
            b = f.read(4)
            f.seek(at)
            f.write(bytes(x ^ 0x5A for x in b))
    warnings_seen.clear()
    again = load_model(path, "auto", "cpu", None, "w8a8")
    assert _same(cold, _logits(again))
    assert len(warnings_seen) == 1, warnings_seen
    line = warnings_seen[0]
    assert str(entry) in line and "converting again" in line and "\n" not in line
    want = {"truncate": "truncated", "empty": "truncated", "flip-data": "fails its checksum",
            "flip-header": "header checksum"}[damage]
    assert want in line
    # The rebuilt entry is whole again: the next load is a silent hit.
    (rebuilt,) = _entries(cache)
    assert rebuilt.stat().st_size == size
    warnings_seen.clear()
    _no_convert(monkeypatch)
    assert _same(cold, _logits(load_model(path, "auto", "cpu", None, "w8a8"))) and not warnings_seen


def test_cache_location_key_and_opt_out(tiny_models, tmp_path, monkeypatch):
    path = tiny_models["qwen2"]
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "elsewhere"))
    load_model(path, "auto", "cpu", None, "w4a8")
    load_model(path, "auto", "cpu", None, "w8a8")
    names = sorted(p.name for p in _entries(tmp_path / "elsewhere"))
    assert len(names) == 2 and names[0].startswith("qwen2.w4a8.") and names[1].startswith("qwen2.w8a8.")
    monkeypatch.setenv("SPECDECODE_PACKED_CACHE", "0")
    load_model(path, "auto", "cpu", None, "int8")
    assert len(_entries(tmp_path / "elsewhere")) == 2
    # Touching the source changes its identity: a new entry replaces the old one for that format.
    monkeypatch.delenv("SPECDECODE_PACKED_CACHE")
    st = (path / "model.safetensors").stat()
    os.utime(path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        load_model(path, "auto", "cpu", None, "w8a8")
    finally:
        os.utime(path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    after = sorted(p.name for p in _entries(tmp_path / "elsewhere"))
    assert len(after) == 2 and after[0] == names[0] and after[1] != names[1]


_CHILD = """
import hashlib, sys, time
from pathlib import Path
go = Path(sys.argv[2])
print("ready", flush=True)
while not go.exists():
    time.sleep(0.01)
from specdecode.models.loader import load_model
sys.path.insert(0, sys.argv[3])
from test_packed_cache import _logits
out = _logits(load_model(Path(sys.argv[1]), "auto", "cpu", None, "w4a8"))
print(hashlib.sha256(b"".join(t.numpy().tobytes() for t in out)).hexdigest())
"""


def test_concurrent_writers_never_corrupt(tiny_models, cache, tmp_path):
    path = tiny_models["qwen3"]
    want = hashlib.sha256(b"".join(t.numpy().tobytes() for t in _logits(
        load_model(path, "auto", "cpu", None, "w4a8", packed_cache=False)))).hexdigest()
    go = tmp_path / "go"
    env = {**os.environ, "SPECDECODE_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(go), str(Path(__file__).parent)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    for p in procs:  # all at the start line before the race begins
        assert p.stdout.readline() == "ready\n", p.communicate()[1][-2000:]
    go.touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert [o[0].strip() for o in outs] == [want] * 3
    assert len(_entries(cache)) == 1 and not list((cache / "packed").glob("*.tmp-*"))


def test_concurrent_write_entry_and_readers(cache):
    """Threads writing one entry while others read it: a reader sees no entry or a whole one, never a part."""
    final = pc.cache_root() / "x.w8a8.0000.spk"
    key = {"format": "w8a8", "source": [["/nonexistent-but-ok", 1, 1]]}
    tensors = {f"t{i}": torch.arange(200_000, dtype=torch.int32) * (i + 1) for i in range(8)}
    errors: list[BaseException] = []
    seen: list[int] = []

    def write():
        try:
            pc.write_entry(final, key, {"m": 1}, tensors)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def read():
        deadline = time.time() + 3
        while time.time() < deadline and len(seen) < 50:
            try:
                e = pc.read_entry(final, key)
                assert all(torch.equal(e.tensors[n], t) for n, t in tensors.items())
                seen.append(1)
            except FileNotFoundError:
                pass
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    threads = [threading.Thread(target=write) for _ in range(4)] + [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert seen and final.is_file() and not list(final.parent.glob("*.tmp-*"))


@pytest.mark.parametrize("fmt", ["bf16", "int8", "w8a8", "w4a8", "w6a8"])
def test_pack_in_chunks_is_bitwise_pack_linear(fmt):
    torch.manual_seed(0)
    for n, k in ((1000, 96), (4099, 64), (37, 40)):
        w = torch.randn(n, k)
        a, b = kernels.pack_linear(w, fmt), pack_in_chunks(w, fmt, rows=256)
        assert torch.equal(a.weight, b.weight) and (a.out_features, a.in_features) == (b.out_features, b.in_features)
        assert (a.scale is None and b.scale is None) or torch.equal(a.scale, b.scale)


def test_gguf_quantized_embedding_and_tokenizer_cache(tmp_path, cache, monkeypatch):
    """A real GGUF (a slice of the default draft: Q5_0 embedding, Q8_0 head): the embedding rows decoded from
    the stored blocks are the dense rows bitwise, so the logits equal those of a dense float32 embedding."""
    from test_gguf_loader import draft_path, slice_gguf

    from specdecode.models.gguf_loader import read_gguf
    from specdecode.models.gguf_tokenizer import load_gguf_tokenizer

    src = slice_gguf(draft_path(), tmp_path / "slice.gguf", layers=1, vocab=2048)
    g = read_gguf(src)
    dense = g.load_tensor("model.embed_tokens.weight")
    assert g.tensor_type("model.embed_tokens.weight") == "Q5_0"
    cold_model = load_model(src, "auto", "cpu", None, "w8a8", packed_cache=False)
    cold = _logits(cold_model)
    first = load_model(src, "auto", "cpu", None, "w8a8")
    hit = load_model(src, "auto", "cpu", None, "w8a8")
    emb = hit.model.embed_tokens
    assert isinstance(emb, PackedEmbedding) and emb.encoding == "Q5_0"
    ids = torch.tensor([0, 1, 77, 2047, 77])
    assert torch.equal(emb(ids), dense[ids])
    # Small lookups (decode steps) keep their decoded rows, least recently used out first: the same bits as the
    # table, whatever was kept, and never more rows than the cache's bound.
    emb._max_rows = 3
    for step in ([5], [6, 5], [7], [8, 9], [5, 2047], [0] * 16, list(range(100, 117))):
        got = emb(torch.tensor([step]))
        assert torch.equal(got[0], dense[torch.tensor(step)]), step
        assert len(emb._rows) <= 3
    assert list(emb._rows) == [5, 2047, 0]  # the 17-token lookup (a prompt) was decoded without the cache
    assert _same(cold, _logits(first)) and _same(cold, _logits(hit))
    cold_model.model.embed_tokens = torch.nn.Embedding.from_pretrained(dense)
    assert _same(cold, _logits(cold_model))
    # The tokenizer is cached beside the entries and rebuilt identically.
    real = draft_path()
    built = load_gguf_tokenizer(real, cache=False)
    for _ in range(2):
        tok = load_gguf_tokenizer(real)
        for text in ("hello world", "def f(x):\n    return x  # 日本語 <|im_end|>", " \t ünï 🙂"):
            assert tok.encode(text) == built.encode(text)
        assert (tok.chat_template, tok.eos_token, tok.bos_token, tok.pad_token, tok.model_max_length) == (
            built.chat_template, built.eos_token, built.bos_token, built.pad_token, built.model_max_length)
        assert tok.name_or_path == str(real)
    assert len(list((cache / "tokenizers").iterdir())) == 1


# ------------------------------------------------------------------------------------------------ size budget
_ENTRY_FLOATS = 16 << 10  # a 64 KiB tensor: each entry is one 4 KiB header page plus the data


class _LeveledLines(_Lines):
    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


@pytest.fixture
def log_seen():
    """Every "specdecode" line from INFO up, as (level name, message)."""
    h = _LeveledLines(logging.INFO)
    log = logging.getLogger("specdecode")
    old = log.level
    log.addHandler(h)
    log.setLevel(logging.INFO)
    try:
        yield h.lines
    finally:
        log.removeHandler(h)
        log.setLevel(old)


def _put(cache: Path, name: str) -> pc.Entry:
    """Write an entry for the (existing) source file ``name`` beside the cache dir; returns it mapped."""
    src = cache.parent / name
    src.touch()
    key = {"format": "fp32", "source": [[str(src), 0, 0]]}
    return pc.write_entry(pc.cache_root() / f"{name}.fp32.0000.spk", key, {},
                          {"w": torch.full((_ENTRY_FLOATS,), float(len(name)))})


def _budget(monkeypatch, entries: float) -> None:
    size = 4096 + 4 * _ENTRY_FLOATS
    monkeypatch.setenv("SPECDECODE_PACKED_CACHE_MAX_GB", repr(entries * size / 2**30))


def _names(cache: Path) -> list[str]:
    return [p.name.split(".")[0] for p in _entries(cache)]


def test_budget_from_environment(monkeypatch, warnings_seen):
    monkeypatch.delenv("SPECDECODE_PACKED_CACHE_MAX_GB", raising=False)
    assert pc.max_bytes() == 20 * 2**30
    monkeypatch.setenv("SPECDECODE_PACKED_CACHE_MAX_GB", "1.5")
    assert pc.max_bytes() == 3 * 2**29
    monkeypatch.setenv("SPECDECODE_PACKED_CACHE_MAX_GB", "0")
    assert pc.max_bytes() is None
    monkeypatch.setenv("SPECDECODE_PACKED_CACHE_MAX_GB", "lots")
    assert pc.max_bytes() == 20 * 2**30 and len(warnings_seen) == 1 and "lots" in warnings_seen[0]


def test_eviction_drops_the_least_recently_used(cache, monkeypatch, log_seen):
    _budget(monkeypatch, 2.5)
    _put(cache, "a")
    _put(cache, "b")
    assert not log_seen  # two entries fit: no eviction pass
    assert pc.open_entry(pc.cache_root() / "a.fp32.0000.spk",
                         {"format": "fp32", "source": [[str(cache.parent / "a"), 0, 0]]}) is not None
    _put(cache, "c")  # a was used after b was written, so b is the least recently used
    assert _names(cache) == ["a", "c"]
    assert [lvl for lvl, _ in log_seen] == ["INFO"]
    assert "evicted 1 least recently used entries" in log_seen[0][1] and "\n" not in log_seen[0][1]
    # With no bound nothing goes.
    monkeypatch.setenv("SPECDECODE_PACKED_CACHE_MAX_GB", "0")
    for n in "bde":
        _put(cache, n)
    assert _names(cache) == ["a", "b", "c", "d", "e"]


def test_eviction_spares_entries_mapped_in_this_process(cache, monkeypatch):
    _budget(monkeypatch, 2.5)
    held = _put(cache, "a")  # the least recently used, but its tensors are still mapped
    _put(cache, "bb")
    _put(cache, "ccc")
    assert _names(cache) == ["a", "ccc"]
    assert torch.equal(held.tensors["w"], torch.full((_ENTRY_FLOATS,), 1.0))
    del held  # nothing maps a any more: the next pass may take it
    _put(cache, "dddd")
    assert _names(cache) == ["ccc", "dddd"]


def test_budget_below_one_entry_keeps_the_new_one(cache, monkeypatch, warnings_seen):
    _budget(monkeypatch, 0.5)
    monkeypatch.setattr(pc, "_warned_small_budget", False)
    # Another live writer's temporary (our own pid is alive) must outlast any pass.
    pc.cache_root().mkdir(parents=True)
    tmp = pc.cache_root() / f"z.fp32.0000.spk.tmp-{os.getpid()}-0000"
    tmp.write_bytes(bytes(1 << 20))
    _put(cache, "a")
    assert _names(cache) == ["a"]
    _put(cache, "b")
    _put(cache, "c")
    assert _names(cache) == ["c"] and tmp.is_file()
    assert len(warnings_seen) == 1 and "alone exceeds the cache budget" in warnings_seen[0]


def test_the_one_call_checksums_equal_torch_sums_from_the_mapping_and_from_the_file(tmp_path):
    """kernels.words_sums (every tensor of an entry in one GIL-free call) against the torch sums it replaces:
    odd lengths, words that wrap modulo 2^64, items read from the file, and a file that ends inside an item."""
    import mmap

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
    data[:4096] = 255  # words near 2^64: the sums wrap
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes() + bytes(8))  # whole words past the last item, as entries are padded
    items = [(0, 4096, False), (3, 17, False), (64, 1 << 19, True), (100, 1, True), (8192, 999_999, False),
             (0, 0, False)]
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # as entries are mapped
        base = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
        got = kernels.words_sums(base, f.fileno(), items)
        assert got is not None, "the extension is built for these tests"
        whole = torch.cat([data, torch.zeros(8, dtype=torch.uint8)])  # a sum reads an item's last word whole
        want = [pc._words_sum(whole[off:off + -(-n // 8) * 8].clone()) for off, n, _ in items]
        assert got == want
        assert [pc._file_words_sum(f.fileno(), off, n) for off, n, _ in items] == want
        assert kernels.words_sums(base, f.fileno(), [(len(data) - 8, 64, True)]) == [None]
        del base
        mm.close()
