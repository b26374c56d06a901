"""Long contexts: the default max_model_len is the model's trained context, and a draft model with a bounded
context (attention sinks + a recent window, re-indexed) leaves greedy output exactly plain greedy decoding's,
across prefix caching, chunked prefill and batching, while the draft never sees more than its window."""
from __future__ import annotations

import random

import pytest

from specdecode import LLM, SamplingParams
from specdecode.speculative.draft_model import DRAFT_SINKS

from helpers_spec import GREEDY, copy_model, edit_config, noisy_drafts, one_thread  # noqa: F401  (fixtures)

WINDOW = 16
K = 4


def _run(llm, prompts, max_tokens):
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                        sampling_params=SamplingParams(max_tokens=max_tokens, **GREEDY))
    return [list(o.outputs[0].token_ids) for o in outs]


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    head = [rng.randrange(5, 500) for _ in range(70)]
    prompts = [head + [rng.randrange(5, 500) for _ in range(10 + 37 * i)] for i in range(3)]
    prompts.append([rng.randrange(5, 500) for _ in range(20)])  # short: its draft sees it whole until it grows
    return prompts + [list(prompts[1])]  # an exact repeat: the prefix cache holds all but its last block


def test_default_max_model_len_is_the_trained_context(tiny_models, tiny_dir, one_thread):
    model = copy_model(tiny_models["llama"], tiny_dir / "llama_32k")
    edit_config(model, max_position_embeddings=32768)  # the default pair's trained context
    llm = LLM(str(model), speculative_config={"method": "none"})
    engine = llm.llm_engine
    assert engine.max_model_len == 32768
    pool = engine.pool
    assert pool.num_blocks == 8 * 32768 // 16  # every slot can hold the whole context (address space only)
    assert pool.resident_blocks == 8 * 4096 // 16  # what the prefix cache keeps written beyond that is bounded
    prompt = list(range(5, 500)) * 5  # 2475 tokens: past the old 4096 default once answered, fine here
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=4, **GREEDY),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    explicit = LLM(str(model), max_model_len=300, speculative_config={"method": "none"})
    assert explicit.llm_engine.max_model_len == 300


@pytest.mark.parametrize("fam", ["llama", "opt"])  # the C++ layer stack, and the Python attention path
def test_bounded_draft_is_exact_and_never_sees_more_than_its_window(fam, tiny_models, noisy_drafts, one_thread):
    model, draft = tiny_models[fam], noisy_drafts[fam]
    prompts = _prompts()
    ref_llm = LLM(str(model), max_model_len=512, enable_prefix_caching=False, max_num_batched_tokens=4096,
                  speculative_config={"method": "none"})
    ref = _run(ref_llm, prompts, 60)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K, "draft_window": WINDOW}
    llm = LLM(str(model), max_model_len=512, max_num_batched_tokens=16, max_num_seqs=8, speculative_config=spec)
    runner = llm.llm_engine.draft_runner
    seen: list[int] = []
    pass_ = runner._pass

    def spy(seqs, all_logits, prefill):
        seen.extend(start + len(toks) for _, start, toks in seqs)
        return pass_(seqs, all_logits, prefill)

    runner._pass = spy
    for batched in (False, True):
        seen.clear()
        got = _run(llm, prompts, 60) if batched else [_run(llm, [p], 60)[0] for p in prompts]
        assert got == ref, f"batched={batched}"
        # the draft's re-indexed positions stay within sinks + 2 windows + one step's drafts, while the
        # contexts reach 70 + 84 + 60 tokens
        assert seen and max(seen) <= DRAFT_SINKS + 2 * WINDOW + K
    stats = llm.llm_engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    pool = llm.llm_engine.pool
    assert pool.hits > 0
    pool.check_consistency()
    assert pool.num_used_blocks == 0  # every window's private blocks went back


def test_window_zero_keeps_the_whole_context_and_bad_values_are_refused(tiny_models, noisy_drafts, one_thread):
    model, draft = tiny_models["llama"], noisy_drafts["llama"]
    prompts = _prompts()[:2]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K, "draft_window": 0}
    llm = LLM(str(model), max_model_len=512, speculative_config=spec)
    runner = llm.llm_engine.draft_runner
    seen: list[int] = []
    pass_ = runner._pass
    runner._pass = lambda seqs, a, prefill: (seen.extend(s + len(t) for _, s, t in seqs), pass_(seqs, a, prefill))[1]
    _run(llm, prompts, 30)
    assert max(seen) >= len(prompts[1]) + 20  # real positions: the draft holds the whole context
    for bad in (-1, 2.5, "x"):
        with pytest.raises(ValueError, match="draft_window"):
            LLM(str(model), speculative_config=dict(spec, draft_window=bad))
    with pytest.raises(ValueError, match="draft_window"):
        LLM(str(model), speculative_config={"method": "ngram", "draft_window": 64})


def test_long_context_bench_rows_per_length(tiny_models, tiny_draft, tmp_path, capsys):
    """`specdecode bench --dataset long`: prompts built offline from local source files, one row per length,
    speculation on and off on the same prompts, greedy outputs identical."""
    import json

    import torch

    from specdecode.entrypoints.cli import main

    threads = torch.get_num_threads()
    out = tmp_path / "long.json"
    try:
        rc = main(["bench", "-m", str(tiny_models["llama"]), "-md", str(tiny_draft), "--dataset", "long",
                   "--lengths", "300,600", "--method", "draft", "--k", "2", "--draft-window", "64",
                   "--max-tokens", "8", "--output-json", str(out), "--no-progress", "-t", "1"])
        assert rc == 0, capsys.readouterr().err
        report = capsys.readouterr().out
        r = json.loads(out.read_text())
        assert r["meta"]["dataset_format"] == "long-context" and r["categories"] == ["300", "600"]
        assert r["meta"]["draft_window"] == 64
        for run in r["runs"]:
            n = int(run["category"])
            assert n - 80 <= run["prompt_tokens"] <= n, run["prompt_tokens"]  # cut to fit its length
        assert {x["config"] for x in r["runs"]} == {"baseline", "draft k=2"}
        assert r["overall"]["draft k=2"]["greedy_mismatches"] == 0
        assert "Per prompt length" in report and "e2e vs plain" in report
        # a length the context cannot hold, and --lengths without the long dataset: one-line errors
        base = ["bench", "-m", str(tiny_models["llama"]), "--method", "ngram", "-t", "1", "--no-progress"]
        assert main([*base, "--dataset", "long", "--lengths", "2k"]) == 2
        assert "exceeds max_model_len" in capsys.readouterr().err
        assert main([*base, "--dataset", "humaneval", "--lengths", "2k"]) == 2
        assert "--lengths applies to --dataset long" in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("chars_per_token", [2.5, 4.5])
def test_long_context_prompts_fill_their_length(chars_per_token):
    """Each document is cut to its length by the counter it is given, whatever the text's characters per token
    (source code runs 3 to 4.5 with real tokenizers): it fills the length but for the margin, never more."""
    from specdecode.bench.datasets import _LONG_MARGIN, long_context_dataset

    def count(text: str) -> int:
        return int(len(text) / chars_per_token)

    lengths = [2048, 16384]
    ds = long_context_dataset(lengths, count, per_length=2)
    assert [p.category for p in ds.prompts] == ["2k", "2k", "16k", "16k"]
    for p in ds.prompts:
        n = {"2k": 2048, "16k": 16384}[p.category]
        assert n - _LONG_MARGIN - 2 <= count(p.text) <= n - _LONG_MARGIN, (p.id, count(p.text))
