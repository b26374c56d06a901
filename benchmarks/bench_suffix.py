"""Suffix decoding against today's best config, on one loaded engine, configs interleaved per prompt.

Workloads (``--workload``):
  agentic     an agent's repeated calls: N requests that each rewrite a similar function (same tasks, the
              variable names changed between the two rounds); categories "round1" and "round2".
  tools       an agent's planning calls: N requests that each turn a maintenance task into a JSON list of
              tool calls (the same tools and task kinds, other files and names in round 2); "round1", "round2".
  specbench   Spec-Bench (``--dataset``), ``--per-category`` prompts of each category.
  short       short answers: Spec-Bench prompts capped at ``--max-tokens`` (e.g. 8-32), per answer length.

Configs (``--configs``, comma-separated): baseline is always first.
  best          the adaptive hybrid: draft model (w4a8) k=4, prompt lookup first, lookups up to 12, adaptive k,
                truncated draft head (draft_vocab_size 32768)
  suffix        suffix decoding alone, k=12 (adaptive)
  suffix-draft  suffix matches first, the draft model elsewhere (as best, with suffix decoding as the lookup)
  suffix-f2, suffix-draft-f2   the same with suffix_decoding_max_spec_factor 2 (drafts up to twice the match
                length instead of vLLM's default of once)
  best-again    best's settings in a second proposer of its own (its own learned state): how far two runs of
                one config differ per category, the noise floor a per-category comparison must clear

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
    "best-again": BenchConfig("best again", "hybrid", 4, vocab=VOCAB, lookup_k=12),
}
WARMUP_PROMPT = "Name three primary colours."
# SpeculativeConfig fields a config sets beyond what BenchConfig describes.
OVERRIDES = {"suffix-f2": {"suffix_decoding_max_spec_factor": 2.0},
             "suffix-draft-f2": {"suffix_decoding_max_spec_factor": 2.0},
             # a field best does not read: the engine keeps one proposer per distinct config, so this gives
             # best-again a proposer of its own that behaves as best's
             "best-again": {"suffix_decoding_max_cached_requests": 9999}}


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


TOOLS_SYSTEM = (
    "You are a coding agent working in a Python repository. Answer with only a JSON list of the tool calls "
    "that carry out the task, in order, and nothing else. Each call is an object with \"tool\" and \"args\". "
    "Tools: read_file(path), search(pattern, path), edit_file(path, old, new), run_tests(path), "
    "git_commit(message).")
TOOL_TASKS = [
    "Rename the function `{f}` to `{g}` in `{mod}` and update every call to it in `{test}`.",
    "Add a docstring to the function `{f}` in `{mod}` that explains its `{arg}` argument, then run its tests.",
    "The test `test_{f}` in `{test}` fails because `{f}` in `{mod}` ignores `{arg}`. Find and fix the bug.",
    "Make `{f}` in `{mod}` raise ValueError when `{arg}` is empty, add a test for it to `{test}` and commit.",
    "Replace the print calls in `{f}` in `{mod}` with logging, run the tests in `{test}` and commit.",
]
# (function, new name, module, argument); round 1 takes the first half, round 2 the second, so no request of
# round 2 repeats one of round 1.
TOOL_NAMES = [("parse_config", "load_config", "config", "path"), ("merge_rows", "combine_rows", "table", "rows"),
              ("send_email", "deliver_email", "mailer", "recipients"), ("resize_image", "scale_image", "images",
              "size"), ("fetch_user", "get_user", "accounts", "user_id"), ("split_words", "tokenize", "text",
              "sentence"), ("save_report", "write_report", "reports", "report"), ("check_token", "verify_token",
              "auth", "token"), ("compute_tax", "calculate_tax", "billing", "amount"), ("list_jobs", "get_jobs",
              "scheduler", "queue"), ("read_csv", "load_csv", "loader", "filename"), ("hash_password",
              "digest_password", "security", "password"), ("render_page", "draw_page", "views", "template"),
              ("parse_date", "to_date", "dates", "value"), ("retry_call", "with_retries", "network", "attempts"),
              ("sort_orders", "order_by_date", "orders", "orders"), ("cache_result", "memoize", "caching", "key"),
              ("build_query", "make_query", "database", "filters"), ("send_alert", "notify", "alerts", "level"),
              ("clean_text", "normalize_text", "preprocess", "text")]


def tools_dataset(requests: int) -> Dataset:
    """Round 1: ``requests`` maintenance tasks for the tool-calling agent; round 2: the same task kinds on
    other functions and modules."""
    prompts, half = [], len(TOOL_NAMES) // 2
    for rnd in (1, 2):
        for i in range(requests):
            f, g, mod, arg = TOOL_NAMES[half * (rnd - 1) + i % half]
            task = TOOL_TASKS[i % len(TOOL_TASKS)].format(f=f, g=g, mod=f"src/{mod}.py", test=f"tests/test_{mod}.py",
                                                          arg=arg)
            prompts.append(BenchPrompt(f"r{rnd}-{i}", f"round{rnd}", f"{TOOLS_SYSTEM}\n\nTask: {task}"))
    return Dataset("agentic-tools", "generated", prompts)


# Workloads this script generates (the others are read from --dataset): name -> dataset of N requests a round.
GENERATED = {"agentic": agentic_dataset, "tools": tools_dataset}


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


def against(groups: dict, configs: list[BenchConfig], best: str, key: str) -> dict[str, dict[str, float]]:
    """Per group, each config's ``key`` over best's (configs without a figure, or groups where best has none,
    left out of the group's entry)."""
    return {g: {c.name: by_cfg[c.name][key] / by_cfg[best][key]
                for c in configs if by_cfg[best][key] and by_cfg[c.name][key]}
            for g, by_cfg in groups.items()}


def rounded(ratios: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {g: {k: round(v, 3) for k, v in d.items()} for g, d in ratios.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=(*GENERATED, "specbench", "short"), default="agentic")
    ap.add_argument("--configs", default="best,suffix,suffix-draft")
    ap.add_argument("--requests", type=int, default=20, help="agentic / tools: requests per round")
    ap.add_argument("--per-category", type=int, default=2, help="specbench / short: prompts per category")
    ap.add_argument("--dataset", default=str(SPEC_BENCH))
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantization", default="mixed", help="the target's weights (the default preset's: mixed)")
    ap.add_argument("-o", "--output-json", default=None)
    a = ap.parse_args()

    names = [n for n in a.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
    configs = [BenchConfig("baseline", None)] + [CONFIGS[n] for n in names]
    if a.workload in GENERATED:
        ds = GENERATED[a.workload](a.requests)
    else:
        ds = load_dataset(a.dataset, a.per_category)
    drafting = any(c.method in ("hybrid", "suffix-draft") for c in configs)
    s = BenchSettings(methods=["hybrid"] if drafting else ["suffix"], ks=[4], max_tokens=a.max_tokens,
                      quantization=a.quantization, draft_quantization="w4a8", adaptive=True, num_threads=a.threads,
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
        vs_best = against(groups, configs, best, "decode_tokens_per_s")
        print("\nvs best: " + json.dumps(rounded(vs_best)))
        # The same by the passes' calibrated costs: the configs' choices without the clock's noise.
        result["modeled_vs_best"] = against(groups, configs, best, "modeled_decode_tokens_per_s")
        print("modeled vs best: " + json.dumps(rounded(result["modeled_vs_best"])))
    mism = {c.name: result["overall"][c.name]["greedy_mismatches"] for c in configs}
    print("greedy mismatches vs baseline:", mism)
    lengths = per_length(result, [1, 8, 17, 25, 33, 65, 129, 10**6]) if a.workload not in GENERATED else []
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
