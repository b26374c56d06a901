"""Suffix decoding against today's best config, on one loaded engine, configs interleaved per prompt.

Workloads (``--workload``):
  agentic     an agent's repeated calls: N requests that each rewrite a similar function (same tasks, the
              variable names changed between the two rounds); categories "round1" and "round2".
  specbench   Spec-Bench (``--dataset``), ``--per-category`` prompts of each category.
  short       short answers: Spec-Bench prompts capped at ``--max-tokens`` (e.g. 8-32), per answer length.

Configs (``--configs``, comma-separated): baseline is always first.
  best          the adaptive hybrid: draft model (w4a8) k=4, prompt lookup first, lookups up to 12, adaptive k,
                truncated draft head (draft_vocab_size 32768)
  suffix        suffix decoding alone, k=12 (adaptive)
  suffix-draft  suffix matches first, the draft model elsewhere (as best, with suffix decoding as the lookup)
  suffix-f2, suffix-draft-f2   the same with suffix_decoding_max_spec_factor 2 (drafts up to twice the match
                length instead of vLLM's default of once)

Example:
  python benchmarks/bench_suffix.py --workload agentic --requests 20 --max-tokens 160 -o agentic.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from specdecode.bench.datasets import BenchPrompt, Dataset, load_dataset
from specdecode.bench.runner import BenchConfig, BenchRunner, BenchSettings

SPEC_BENCH = "../shared/bench/spec_bench_questions.jsonl"  # from the repository's folder
VOCAB = 32768
CONFIGS = {
    "best": BenchConfig("best (hybrid k=4 lookup=12)", "hybrid", 4, vocab=VOCAB, lookup_k=12),
    "suffix": BenchConfig("suffix k=12", "suffix", 12),
    "suffix-draft": BenchConfig("suffix+draft k=4 lookup=12", "suffix-draft", 4, vocab=VOCAB, lookup_k=12),
    "suffix-f2": BenchConfig("suffix k=12 F=2", "suffix", 12),
    "suffix-draft-f2": BenchConfig("suffix+draft k=4 lookup=12 F=2", "suffix-draft", 4, vocab=VOCAB, lookup_k=12),
}
WARMUP_PROMPT = "Name three primary colours."
# SpeculativeConfig fields a config sets beyond what BenchConfig describes.
OVERRIDES = {"suffix-f2": {"suffix_decoding_max_spec_factor": 2.0},
             "suffix-draft-f2": {"suffix_decoding_max_spec_factor": 2.0}}


class SuffixBenchRunner(BenchRunner):
    """BenchRunner whose configs may set suffix decoding's own options (OVERRIDES)."""

    def __init__(self, settings: BenchSettings, configs: list[BenchConfig], overrides: dict[str, dict]):
        super().__init__(settings)
        self.configs, self.overrides = configs, overrides

    def load(self) -> None:
        super().load()
        for name, fields in self.overrides.items():
            self._spec[name] = dataclasses.replace(self._spec[name], **fields)

    def run(self, dataset: Dataset) -> dict:
        # BenchRunner warms up on the dataset's shortest prompt, which would leave that prompt's answer in
        # suffix decoding's cache of earlier outputs and let it copy the answer when the prompt comes up. Warm
        # up on a prompt outside the dataset instead.
        if self.s.warmup:
            if self.engine is None:
                self.load()
            ids = self.encode(WARMUP_PROMPT)
            for cfg in self.configs:
                self.generate(cfg, ids, self._params(0, min(self.s.max_tokens, 16)))
            self.s = dataclasses.replace(self.s, warmup=False)
            result = super().run(dataset)
            self.s = dataclasses.replace(self.s, warmup=True)
            result["meta"]["warmup"] = f"one excluded generation per config, of {WARMUP_PROMPT!r}"
            return result
        return super().run(dataset)


# Functions an agent is asked to rewrite; {a}, {b}, {c} are the variable names, which change between rounds.
FUNCTIONS = [
    "def {a}({b}):\n    {c} = 0\n    for x in {b}:\n        if x > 0:\n            {c} += x\n    return {c}\n",
    "def {a}({b}, {c}):\n    out = []\n    for i in range(len({b})):\n        if {b}[i] == {c}:\n"
    "            out.append(i)\n    return out\n",
    "def {a}({b}):\n    {c} = {{}}\n    for w in {b}.split():\n        {c}[w] = {c}.get(w, 0) + 1\n    return {c}\n",
    "def {a}({b}):\n    {c} = []\n    for row in {b}:\n        {c}.append(sum(row) / len(row))\n    return {c}\n",
    "def {a}({b}, {c}):\n    if not {b}:\n        return None\n    best = {b}[0]\n    for x in {b}:\n"
    "        if {c}(x) > {c}(best):\n            best = x\n    return best\n",
]
TASKS = [
    "Rewrite this Python function with type hints and a docstring, keeping its behaviour:",
    "Refactor this Python function to be more readable (type hints, a docstring, clear names), same behaviour:",
    "Add type hints, a docstring and input validation to this Python function:",
    "Rewrite this Python function in idiomatic Python with type hints and a docstring:",
]
NAMES = [("total_positive", "values", "acc"), ("find_all", "items", "target"), ("word_counts", "text", "counts"),
         ("row_means", "matrix", "means"), ("argmax_by", "xs", "key"), ("sum_pos", "nums", "total"),
         ("indices_of", "seq", "needle"), ("count_words", "sentence", "freq"), ("averages", "rows", "result"),
         ("best_of", "candidates", "score")]


def agentic_dataset(requests: int) -> Dataset:
    """Round 1: ``requests`` (task, function) pairs; round 2: the same ones with other variable names."""
    prompts = []
    for rnd in (1, 2):
        for i in range(requests):
            fn = FUNCTIONS[i % len(FUNCTIONS)]
            task = TASKS[(i // len(FUNCTIONS)) % len(TASKS)]
            a, b, c = NAMES[(i + 5 * (rnd - 1) + i // len(FUNCTIONS)) % len(NAMES)]
            code = fn.format(a=a, b=b, c=c)
            prompts.append(BenchPrompt(f"r{rnd}-{i}", f"round{rnd}", f"{task}\n\n```python\n{code}```"))
    return Dataset("agentic-rewrite", "generated", prompts)


def per_length(result: dict, edges: list[int]) -> list[dict]:
    """Speedup of each config over baseline per group of answer lengths (the baseline's output tokens)."""
    runs = result["runs"]
    base = {r["prompt_id"]: r for r in runs if r["config"] == "baseline"}
    rows = []
    for lo, hi in zip(edges, edges[1:]):
        ids = {pid for pid, r in base.items() if lo <= r["output_tokens"] < hi}
        if not ids:
            continue
        row = {"lengths": f"{lo}-{hi - 1}", "prompts": len(ids)}
        for cfg in dict.fromkeys(r["config"] for r in runs):
            sel = [r for r in runs if r["config"] == cfg and r["prompt_id"] in ids]
            tok = sum(max(0, r["output_tokens"] - 1) for r in sel)
            t = sum(r["decode_time_s"] for r in sel)
            e2e = sum(r["e2e_latency_s"] for r in sel)
            row[cfg] = {"decode_tok_s": tok / t if t else None, "e2e_s": e2e}
        b = row["baseline"]
        for cfg, v in row.items():
            if isinstance(v, dict) and b["decode_tok_s"] and v["decode_tok_s"]:
                v["speedup"] = v["decode_tok_s"] / b["decode_tok_s"]
                v["e2e_speedup"] = b["e2e_s"] / v["e2e_s"]
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("agentic", "specbench", "short"), default="agentic")
    ap.add_argument("--configs", default="best,suffix,suffix-draft")
    ap.add_argument("--requests", type=int, default=20, help="agentic: requests per round")
    ap.add_argument("--per-category", type=int, default=2, help="specbench / short: prompts per category")
    ap.add_argument("--dataset", default=str(SPEC_BENCH))
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("-o", "--output-json", default=None)
    a = ap.parse_args()

    names = [n for n in a.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
    configs = [BenchConfig("baseline", None)] + [CONFIGS[n] for n in names]
    if a.workload == "agentic":
        ds = agentic_dataset(a.requests)
    else:
        ds = load_dataset(a.dataset, a.per_category)
    drafting = any(c.method in ("hybrid", "suffix-draft") for c in configs)
    s = BenchSettings(methods=["hybrid"] if drafting else ["suffix"], ks=[4], max_tokens=a.max_tokens,
                      quantization="w8a8", draft_quantization="w4a8", adaptive=True, num_threads=a.threads,
                      progress=sys.stderr.isatty(), warmup=True)
    runner = SuffixBenchRunner(s, configs, {CONFIGS[n].name: OVERRIDES[n] for n in names if n in OVERRIDES})
    result = runner.run(ds)
    groups = {"overall": result["overall"], **result["per_category"]}
    print(f"{'group':<22}" + "".join(f"{c.name:>34}" for c in configs))
    for g, by_cfg in groups.items():
        cells = []
        for c in configs:
            m = by_cfg[c.name]
            mal = m["mean_acceptance_length"]
            cells.append(f"{m['decode_tokens_per_s'] or 0:6.1f} tok/s {m['speedup'] or 0:5.2f}x"
                         + (f" MAL {mal:4.2f}" if mal else "          "))
        print(f"{g:<22}" + "".join(f"{x:>34}" for x in cells))
    vs_best = {}
    if "best" in names:
        best = CONFIGS["best"].name
        for g, by_cfg in groups.items():
            vs_best[g] = {c.name: by_cfg[c.name]["decode_tokens_per_s"] / by_cfg[best]["decode_tokens_per_s"]
                          for c in configs if by_cfg[best]["decode_tokens_per_s"] and by_cfg[c.name]["decode_tokens_per_s"]}
        print("\nvs best: " + json.dumps({g: {k: round(v, 3) for k, v in d.items()} for g, d in vs_best.items()}))
    mism = {c.name: result["overall"][c.name]["greedy_mismatches"] for c in configs}
    print("greedy mismatches vs baseline:", mism)
    lengths = per_length(result, [1, 8, 17, 25, 33, 65, 129, 10**6]) if a.workload != "agentic" else []
    for row in lengths:
        print(row["lengths"], row["prompts"], {k: (round(v["speedup"], 3), round(v["e2e_speedup"], 3))
                                               for k, v in row.items() if isinstance(v, dict) and "speedup" in v})
    if a.output_json:
        result["vs_best"], result["per_length"] = vs_best, lengths
        Path(a.output_json).write_text(json.dumps(result, indent=1))
    print("median TTFT:", {c.name: round(statistics.median(r["ttft_s"] for r in result["runs"]
                                                            if r["config"] == c.name), 3) for c in configs})


if __name__ == "__main__":
    main()
