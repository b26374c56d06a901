"""Decoding with the weights on huge pages against the file's 4 KiB pages, alternated in one process.

Builds two engines over the same packed files: one with ``$SPECDECODE_NO_HUGE_PAGES=1`` (its weights stay in the
file mapping), one whose weights move onto huge pages while it is idle (``specdecode.models.huge_pages``). It
waits for the move, then decodes the same prompts with each engine in turn, the order swapped every round, so
that a noisy machine's slow minutes fall on both. Prints tok/s per engine and their ratio; greedy outputs must
match.

    python benchmarks/bench_huge_pages.py                       # plain decoding (--spec-type none)
    python benchmarks/bench_huge_pages.py --default --rounds 6  # the default speculative config
"""
from __future__ import annotations

import argparse
import os
import time

from specdecode import LLM, SamplingParams
from specdecode.models import huge_pages

PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain how a refrigerator works to a ten-year-old.",
           "Write a Python function that merges two sorted lists."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--default", action="store_true", help="the default speculative config (else plain decoding)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--wait", type=float, default=30.0, help="seconds to wait at most for the move")
    args = ap.parse_args()
    if not huge_pages.usable():
        raise SystemExit("huge pages are not usable here (not Linux, THP 'never', or SPECDECODE_NO_HUGE_PAGES set)")
    kw = {} if args.default else {"speculative_config": {"method": "none"}}

    os.environ["SPECDECODE_NO_HUGE_PAGES"] = "1"  # read at load: this engine's weights are not registered
    small = LLM(**kw)
    del os.environ["SPECDECODE_NO_HUGE_PAGES"]
    huge = LLM(**kw)
    t0 = time.perf_counter()
    last = -1
    while time.perf_counter() - t0 < args.wait and (huge_pages.moved_bytes() == 0 or huge_pages.moved_bytes() != last):
        last = huge_pages.moved_bytes()
        time.sleep(1.0)  # done once a second passes with nothing more moved
    print(f"moved {huge_pages.moved_bytes() / 2**20:.0f} MiB onto huge pages in {time.perf_counter() - t0:.1f} s")

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    speeds: dict[str, list[float]] = {"4 KiB": [], "huge": []}
    texts: dict[str, list[list[int]]] = {"4 KiB": [], "huge": []}
    for rnd in range(args.rounds):
        order = [("4 KiB", small), ("huge", huge)]
        for name, llm in order if rnd % 2 == 0 else order[::-1]:
            for prompt in PROMPTS:
                t = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
                speeds[name].append(len(out.token_ids) / (time.perf_counter() - t))
                texts[name].append(list(out.token_ids))
    a, b = (sum(v) / len(v) for v in speeds.values())
    same = texts["4 KiB"] == texts["huge"]
    print(f"4 KiB pages {a:.2f} tok/s, huge pages {b:.2f} tok/s: {b / a:.3f}x; outputs identical: {same}")


if __name__ == "__main__":
    main()
