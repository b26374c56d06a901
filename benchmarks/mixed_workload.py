"""Write a chunked-prefill workload for `specdecode bench serve`: short Spec-Bench chat prompts with a long
summarization prompt (700-900 tokens) after every third one, so long prefills arrive while other streams
decode. Compare ITL p99 with `--max-num-batched-tokens 256` (chunked) and a budget above the longest prompt.

    python benchmarks/mixed_workload.py mixed.jsonl
    specdecode bench serve --base-url URL --dataset mixed.jsonl --num-prompts 16 --max-concurrency 4 --max-tokens 64
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

SPEC_BENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "bench" / "spec_bench_questions.jsonl"


def mixed_prompts(path: Path = SPEC_BENCH, groups: int = 4) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    longs = [r["turns"][0] for r in rows if r.get("category") == "summarization"][:groups]
    shorts = [r["turns"][0] for r in rows if r.get("category") in ("writing", "qa", "coding", "translation")]
    out = []
    for g, long in enumerate(longs):
        out += shorts[3 * g:3 * g + 3] + [long]
    return out


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[0], "\nusage: mixed_workload.py OUT.jsonl", file=sys.stderr)
        return 2
    with open(sys.argv[1], "w") as f:
        for p in mixed_prompts():
            f.write(json.dumps({"prompt": p}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
