"""Our native implementations against transformers' in fp32: logits within 1e-3 (max abs), identical greedy
32-token continuations. Tiny random models of every family, and the real default pair (GGUF)."""
from __future__ import annotations

import gc
import mmap
import struct
from pathlib import Path

import pytest
import torch

from specdecode import LLM, SamplingParams
from specdecode.engine.model_runner import ModelRunner
from specdecode.models.loader import load_model

from helpers_spec import one_thread  # noqa: F401  (fixture)

FAMILIES = ("llama", "qwen2", "qwen3", "opt", "gpt2")
LOGITS_TOL = 1e-3
N_GREEDY = 32


def _hf_model(path, **kw):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw)
    m.eval()
    return m


@torch.inference_mode()
def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    return model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float()


@torch.inference_mode()
def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, eos_token_id=None, pad_token_id=0, num_beams=1)
    return out[0, len(ids):].tolist()


def _our_logits(path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prefill's last-row logits, all rows through the verification path, rows h-1.. of a split run: a
    prefill of the first h tokens, then the rest as one multi-token decode over the cached prefix)."""
    runner = ModelRunner(load_model(path, "float32", "cpu", 256, None), 2, 256, "cpu")
    last = runner.prefill(0, ids)
    rows = runner.forward_rows([(1, 0, ids)], all_logits=True)[0]
    h = len(ids) // 2
    first = runner.prefill(0, ids[:h])  # slot 0 again: overwrites the earlier prefill, as a rollback would
    rest = runner.forward_rows([(0, h, ids[h:])], all_logits=True)[0]
    return last, rows, torch.cat([first[None], rest])


def _prompt(vocab: int, n: int = 24, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("fam", FAMILIES)
def test_tiny_logits_match_transformers(fam, tiny_models, one_thread):
    path = tiny_models[fam]
    hf = _hf_model(path)
    ids = _prompt(hf.config.vocab_size)
    want = _hf_logits(hf, ids)
    last, rows, split = _our_logits(path, ids)
    assert rows.shape == want.shape
    h = len(ids) // 2
    for name, got, ref in (("prefill", last, want[-1]), ("verify rows", rows, want),
                           ("prefill + cached decode", split, want[h - 1:])):
        diff = (got - ref).abs().max().item()
        assert diff < LOGITS_TOL, f"{fam} {name}: max abs logits diff {diff:.2e}"
    assert want.std().item() > 0.1  # the logits are not trivially flat


@pytest.mark.parametrize("fam", FAMILIES)
def test_tiny_greedy_matches_transformers(fam, tiny_models, one_thread):
    path = tiny_models[fam]
    hf = _hf_model(path)
    llm = LLM(str(path), max_model_len=128)
    for seed in (0, 1):
        ids = _prompt(hf.config.vocab_size, seed=seed)
        want = _hf_greedy(hf, ids, N_GREEDY)
        got = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
            temperature=0, max_tokens=N_GREEDY, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
        assert list(got) == want, f"seed {seed}"


# ---------------------------------------------------------------------------------------------------------
# The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft; GGUF Q4_K_M dequantized to fp32)
# ---------------------------------------------------------------------------------------------------------
REAL_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def _gguf_for_transformers(src: Path, dst: Path) -> None:
    """Write a copy of GGUF file ``src`` without its tokenizer metadata: the same tensors and the same model
    metadata, with the vocabulary size transformers would take from the token list as ``<arch>.vocab_size``.
    transformers parses every metadata string of a GGUF file in Python, twice per model load (about 20 s each for
    Qwen2.5's 151k tokens and merges on a slow core), and its model needs none of the tokenizer's. The copy is
    written from the source's bytes (header entries and tensor data unchanged), not re-encoded."""
    from specdecode.models.gguf_loader import _DEFAULT_ALIGNMENT, _Cursor

    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        cur = _Cursor(mm, len(mm))
        cur.take(4)
        version, n_tensors, n_kv = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
        kept, meta = [], {}
        for _ in range(n_kv):
            start = cur.pos
            key = cur.string()
            value = cur.value(cur.scalar("<I"))
            if key.startswith("tokenizer."):
                meta[key] = len(value) if key == "tokenizer.ggml.tokens" else None
            else:
                meta[key] = value
                kept.append(mm[start:cur.pos])
        infos_start = cur.pos
        for _ in range(n_tensors):
            cur.string()
            n_dims = cur.scalar("<I")
            cur.take(8 * n_dims + 4 + 8)  # dims, type, offset
        infos = mm[infos_start:cur.pos]
        align = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
        data_start = -(-cur.pos // align) * align
        vocab_key = f"{meta['general.architecture']}.vocab_size"
        if vocab_key not in meta:
            name = vocab_key.encode()
            kept.append(struct.pack("<Q", len(name)) + name + struct.pack("<II", 4, meta["tokenizer.ggml.tokens"]))
        header = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kept)) + b"".join(kept) + infos
        with open(dst, "wb") as out:
            out.write(header + bytes(-len(header) % align))
            for i in range(data_start, len(mm), 64 << 20):
                out.write(mm[i:i + (64 << 20)])


@pytest.mark.parametrize("role", ["draft", "target"])
def test_default_pair_matches_transformers(role, one_thread, tmp_path):
    """transformers dequantizes the GGUF with the gguf package; we dequantize it with ours. One thread: on
    this shared 2-vCPU machine, 2 spinning threads lose more to contention than they gain."""
    from specdecode.models.resolve import resolve_model

    path = resolve_model(None, role)
    assert path.is_file() and path.suffix == ".gguf", path

    # Ours first, then free it before transformers loads its own fp32 copy (one model in memory at a time).
    # fp32 KV cache: the default 16-bit cache rounds keys and values (logits move by ~5e-3 here), beyond 1e-3.
    llm = LLM(str(path), max_model_len=256, dtype="float32", kv_cache_dtype="float32")
    ids = llm.get_tokenizer().encode(REAL_PROMPT)
    assert 12 <= len(ids) <= 48, len(ids)
    ours_greedy = list(llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0, max_tokens=N_GREEDY, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids)
    runner = llm.engine.target  # idle now: its cache slots are free to use directly
    ours_last = runner.prefill(0, ids)
    ours_rows = runner.forward_rows([(1, 0, ids)], all_logits=True)[0]
    del llm, runner
    gc.collect()

    light = tmp_path / path.name
    _gguf_for_transformers(path, light)
    hf = _hf_model(tmp_path, gguf_file=light.name)
    light.unlink()  # transformers holds the weights in memory now
    want = _hf_logits(hf, ids)
    hf_greedy = _hf_greedy(hf, ids, N_GREEDY)
    del hf
    gc.collect()

    assert ours_rows.shape == want.shape
    for name, got, ref in (("prefill", ours_last, want[-1]), ("verify rows", ours_rows, want)):
        diff = (got - ref).abs().max().item()
        print(f"{role} {name}: max abs logits diff {diff:.2e}")
        assert diff < LOGITS_TOL, f"{role} {name}: max abs logits diff {diff:.2e}"
    assert ours_greedy == hf_greedy
