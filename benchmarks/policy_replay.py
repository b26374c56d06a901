"""Replay the 25-prompt check through one engine and price speculation against plain decoding, per prompt.

    python benchmarks/prompts_25.py /tmp/p25.jsonl
    python benchmarks/policy_replay.py /tmp/p25.jsonl [--set policy._RENT=8] [--show spec-bench-qa] [--json OUT]

Why: the adaptive policy's choices are deterministic for a given calibration (greedy text, acceptance counts,
lengths of finished answers), but the side-by-side check that judges them (serve_compare.py, two servers, ~20
minutes a pair of runs) is noisy enough that one run cannot tell a 3% change in a prompt's ratio. This runs
the prompts in the check's order through one engine with speculation on (prefix caching on and one warm-up
request first, as serve_compare.py's servers have it), records every target and draft pass, and prices each
prompt's decoding both ways with the engine's own calibrated pass costs: with speculation, the passes it ran
(plus ``--overhead`` seconds of the planner's own work per target pass); plain, one one-row pass per token
after the first. The end-to-end ratio adds the measured time to the first token (the same both ways) to both.
Policy constants can be overridden (``--set module.NAME=VALUE``, modules of specdecode.speculative.adaptive)
to compare policies on the same prompts.
"""
from __future__ import annotations

import argparse
import importlib
import json
import time
from dataclasses import asdict, dataclass

SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def chat(prompt: str) -> str:
    """The prompt in the default target's chat template, with the system prompt its server would add."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n"
            "<|im_start|>assistant\n")


@dataclass
class Row:
    category: str
    tokens: int          # tokens generated
    target_passes: int   # decoding passes of the target (prompt prefill left out)
    draft_passes: int
    draft_rows: int      # rows fed to the draft model (its catch-ups included)
    spec_seconds: float  # decoding priced with speculation as it ran
    plain_seconds: float  # the same tokens priced as plain decoding
    first_token_seconds: float  # measured: prompt prefill and the rest before decoding

    @property
    def ratio(self) -> float:
        """Plain end-to-end time / speculative end-to-end time (> 1: speculation is faster)."""
        return (self.first_token_seconds + self.plain_seconds) / (self.first_token_seconds + self.spec_seconds)


def override(assignments: list[str]) -> None:
    """Set ``module.NAME=VALUE`` constants of specdecode.speculative.adaptive's modules."""
    for item in assignments:
        target, _, value = item.partition("=")
        module, _, name = target.rpartition(".")
        mod = importlib.import_module(f"specdecode.speculative.adaptive.{module}")
        if not hasattr(mod, name):
            raise SystemExit(f"--set: specdecode.speculative.adaptive.{module} has no {name}")
        setattr(mod, name, type(getattr(mod, name))(value))


def replay(prompts: list[dict], max_tokens: int, overhead: float, show: set[str], warmup: int) -> list[Row]:
    from specdecode import LLM, SamplingParams

    llm = LLM(model="default")
    engine = llm.llm_engine
    if engine.draft_runner is None or engine.proposer is None:
        raise SystemExit("policy_replay needs the default pair (a draft model and adaptive speculation)")
    passes: list[tuple[bool, bool, int, int]] = []  # (draft, prefill, rows, context after the pass)

    def record(runner, draft: bool) -> None:
        run = runner._pass

        def _pass(seqs, all_logits, prefill):
            passes.append((draft, prefill, sum(len(t) for _, _, t in seqs), max(s + len(t) for _, s, t in seqs)))
            return run(seqs, all_logits, prefill)
        runner._pass = _pass

    record(engine.target, False)
    record(engine.draft_runner, True)
    costs, policy = engine.proposer.costs, engine.proposer.policy
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    for _ in range(warmup):  # as serve_compare.py warms each server up (its answer's length teaches the policy)
        llm.generate([chat("Say hello.")], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    rows = []
    for p in prompts:
        passes.clear()
        t0 = time.perf_counter()
        out = llm.generate([chat(p["prompt"])], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        n, prompt_len = len(out.outputs[0].token_ids), len(out.prompt_token_ids)
        spec = 0.0
        target = draft = draft_rows = 0
        for is_draft, prefill, k, context in passes:
            if is_draft:
                spec += costs.draft_cost(min(context, policy.draft_context or context), k)
                draft, draft_rows = draft + 1, draft_rows + k
            elif not prefill:
                spec += costs.verify_cost(k, context) + overhead
                target += 1
        plain = sum(costs.verify_cost(1, prompt_len + j) for j in range(1, n))
        row = Row(p["category"], n, target, draft, draft_rows, spec, plain, max(0.0, wall - spec))
        rows.append(row)
        print(f"{row.category:28s} tokens {n:4d}  target passes {target:4d}  draft passes {draft:4d} "
              f"({draft_rows:5d} rows)  decode {spec:7.3f} s vs plain {plain:7.3f} s  end to end {row.ratio:5.2f}x",
              flush=True)
        if p["category"] in show:
            print("   ", " ".join(("d" if d else "T") + str(k) for d, pre, k, _ in passes if d or not pre))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts", help="JSONL of {category, prompt} (benchmarks/prompts_25.py)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--overhead", type=float, default=0.001,
                    help="seconds of the planner's and proposer's own work per target pass with speculation on (~1 ms "
                         "measured beside plain decoding)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="override a constant of specdecode.speculative.adaptive (e.g. policy._RENT=8)")
    ap.add_argument("--show", action="append", default=[], metavar="CATEGORY",
                    help="print this prompt's passes (T: target rows, d: draft rows)")
    ap.add_argument("--warmup", type=int, default=1,
                    help='requests of "Say hello." (16 tokens) first, as serve_compare.py sends (its WARMUP)')
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()
    override(a.set)
    prompts = [json.loads(line) for line in open(a.prompts) if line.strip()][:a.limit]
    rows = replay(prompts, a.max_tokens, a.overhead, set(a.show), a.warmup)
    worst = min(rows, key=lambda r: r.ratio)
    total = (sum(r.first_token_seconds + r.plain_seconds for r in rows)
             / sum(r.first_token_seconds + r.spec_seconds for r in rows))
    print(f"lowest: {worst.category} {worst.ratio:.3f}x   below 0.97x: {sum(r.ratio < 0.97 for r in rows)}   "
          f"all prompts: {total:.3f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) | {"ratio": r.ratio} for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
