"""Checks that every model family must pass against transformers, shared by the family test modules: logits,
greedy tokens (plain, batched, under n-gram speculation), bitwise-identical output with prefix caching and chunked
prefill on and off, and the tiny tokenizer written into a GGUF file as llama.cpp writes a BPE vocabulary."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from helpers_spec import GREEDY, PROMPTS, gen_ids
from specdecode import LLM, SamplingParams
from specdecode.engine.model_runner import ModelRunner
from specdecode.models.loader import load_model
from test_hf_parity import _hf_greedy, _hf_logits

# With a float32 KV cache our logits are transformers' up to float32 rounding (about 2e-6 on the tiny models); the
# default 16-bit cache rounds keys and values, which four layers of these tiny models amplify to about 2e-3.
LOGITS_TOL = 1e-4
N_GREEDY = 32


def logits_check(path: Path, hf_model, ids: list[int], label: str) -> None:
    """Prefill's last row, every row through the verification path, and a prefill of the first 21 tokens followed
    by the rest as one multi-token decode over the cached part: all transformers' logits."""
    want = _hf_logits(hf_model, ids)
    runner = ModelRunner(load_model(path, "float32", "cpu", 256, None), 2, 256, "cpu", kv_cache_dtype="float32")
    last = runner.prefill(0, ids)
    rows = runner.forward_rows([(1, 0, ids)], all_logits=True)[0]
    h = 21
    first = runner.prefill(0, ids[:h])
    split = torch.cat([first[None], runner.forward_rows([(0, h, ids[h:])], all_logits=True)[0]])
    for name, got, ref in (("prefill", last, want[-1]), ("verify rows", rows, want),
                           ("prefill + cached decode", split, want[h - 1:])):
        diff = (got - ref).abs().max().item()
        assert diff < LOGITS_TOL, f"{label} {name}: max abs logits diff {diff:.2e}"
    assert want.std().item() > 0.1  # the logits are not trivially flat


def ours(llm, prompts, **kw) -> list[list[int]]:
    return gen_ids(llm, prompts, max_tokens=N_GREEDY, **GREEDY, **kw)


def greedy_check(path: Path, hf_model, first: list[int], llm_cache) -> None:
    """transformers' greedy tokens: each prompt alone, all batched, and under n-gram speculation (k = 4), which
    must accept drafts."""
    prompts = [first, [17, 42, 99, 5, 300, 7] * 4] + PROMPTS  # n-gram drafts match in the looping prompt
    want = [_hf_greedy(hf_model, p, N_GREEDY) for p in prompts]
    plain = llm_cache.get(path, max_model_len=128)
    assert [ours(plain, [p])[0] for p in prompts] == want
    assert ours(plain, prompts) == want  # batched with each other
    ngram = llm_cache.get(path, max_model_len=128, speculative_model="[ngram]", num_speculative_tokens=4)
    for batch in ([prompts[1]], prompts):
        outs = ngram.generate(prompt_token_ids=batch, use_tqdm=False,
                              sampling_params=SamplingParams(max_tokens=N_GREEDY, **GREEDY))
        assert [list(o.outputs[0].token_ids) for o in outs] == [want[prompts.index(p)] for p in batch]
        assert sum(o.metrics.spec_decode.num_accepted_tokens for o in outs) > 0


def _run(llm, prompts, max_tokens=12):
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(max_tokens=max_tokens, logprobs=3, **GREEDY))
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def prefix_cache_check(path: Path) -> None:
    """Prompts sharing a 70-token head (4 whole blocks, far past a window of 8): prefilled whole without the cache,
    or in chunks of 32 with the head's blocks from the cache, the token ids and logprobs are bitwise the same,
    also when they arrive together or run under n-gram speculation."""
    rng = random.Random(1)
    head = [rng.randrange(5, 500) for _ in range(70)]
    prompts = [head + [rng.randrange(5, 500) for _ in range(9 + 3 * i)] for i in range(3)]
    kw = dict(model=str(path), max_model_len=512, seed=0)
    ref_llm = LLM(**kw, enable_prefix_caching=False, max_num_batched_tokens=4096,
                  speculative_config={"method": "none"})
    ref = [_run(ref_llm, [p])[0] for p in prompts]
    llm = LLM(**kw, max_num_batched_tokens=32, speculative_config={"method": "none"})
    got = [_run(llm, [p])[0] for p in prompts]
    pool = llm.llm_engine.pool
    assert pool.hits >= 2 * 64, "the shared head's 4 whole blocks must come from the cache"
    assert got == ref
    assert _run(llm, prompts) == ref  # together, all from the cache
    spec = LLM(**kw, max_num_batched_tokens=32, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert [ids for ids, _ in _run(spec, prompts)] == [ids for ids, _ in ref]
    pool.check_consistency()
    assert pool.num_used_blocks == 0


def add_gpt2_vocab(w, hf_dir: Path) -> None:
    """The tiny byte-level BPE tokenizer of ``hf_dir`` (tiny.build_tokenizer) into GGUF writer ``w`` as llama.cpp
    writes a BPE vocabulary: a ``gpt2`` model, its tokens (padded to the model's vocabulary), types and merges."""
    c = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = {i: t for t, i in tok["model"]["vocab"].items()}
    vocab.update({a["id"]: a["content"] for a in tok["added_tokens"]})
    tokens = [vocab.get(i, f"<unused{i}>") for i in range(c["vocab_size"])]
    specials = {a["id"] for a in tok["added_tokens"]}
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [3 if i in specials or i not in vocab else 1 for i in range(len(tokens))])
    w.add_array("tokenizer.ggml.merges", [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_uint32("tokenizer.ggml.bos_token_id", c["bos_token_id"])
    w.add_uint32("tokenizer.ggml.eos_token_id", c["eos_token_id"])
