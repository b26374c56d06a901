"""The default LLM() of two source trees, alternated in fresh processes: is one revision slower than another?

    git worktree add --detach /tmp/base bd92bd8
    python benchmarks/bench_tree_ab.py --base /tmp/base [--new .] [--rounds 4] [--max-tokens 128]

Each run is a new process with PYTHONPATH set to one tree: it loads the default pair (max_model_len 4096),
warms up with one short request, then generates a few chat prompts greedily one at a time and prints tokens per
second over their wall time (prefill included). The trees take turns, the first one swapped every round, so a
machine whose speed drifts treats both alike. Prints each run, the median and best ratio new / base, and
whether the two trees wrote the same text.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]
from bench_default import PROMPTS  # noqa: E402

CHILD = r'''
import json, sys, time, warnings
warnings.filterwarnings("ignore")
from specdecode import LLM, SamplingParams
from specdecode.tokenizer import apply_chat_template
questions = json.loads(sys.argv[1])
llm = LLM(max_model_len=4096)
prompts = [apply_chat_template(llm.engine.tokenizer, [{"role": "user", "content": q}]) for q in questions]
llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[2]))
t, n, texts = time.perf_counter(), 0, []
for p in prompts:
    o = llm.generate([p], params, use_tqdm=False)[0].outputs[0]
    n, texts = n + len(o.token_ids), texts + [o.text]
print(json.dumps({"tok_s": n / (time.perf_counter() - t), "texts": texts}))
'''

QUESTIONS = [*PROMPTS, "Write a bash script that renames every .txt file in a folder to .md."]


def run(tree: Path, max_tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(QUESTIONS), str(max_tokens)], env=env,
                         capture_output=True, text=True, cwd="/", check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(f"the run in {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="source tree of the reference revision")
    ap.add_argument("--new", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    trees = {"base": args.base.resolve(), "new": args.new.resolve()}
    rates: dict[str, list[float]] = {k: [] for k in trees}
    texts: dict[str, list[str]] = {}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            d = run(trees[name], args.max_tokens)
            rates[name].append(d["tok_s"])
            texts[name] = d["texts"]
            print(f"round {r} {name:4s} {d['tok_s']:7.2f} tok/s", flush=True)
    med = statistics.median(rates["new"]) / statistics.median(rates["base"])
    print(f"new / base: median {med:.3f}x, best {max(rates['new']) / max(rates['base']):.3f}x; "
          f"identical text: {texts['new'] == texts['base']}")


if __name__ == "__main__":
    main()
