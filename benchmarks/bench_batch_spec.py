"""Speculation on vs off under concurrency, in one process: does the default policy ever lose?

One engine (``LLM()`` defaults, i.e. the FAST preset) serves the same chat prompts twice per round, once with
the default speculative config and once with plain decoding (``set_speculative({"method": "none"})``), in
alternating order, wave by wave: each wave of C prompts runs with both configs back to back, C requests in
flight (as C streaming clients sending at once), so that bursts of other work on the machine hit both alike.
It reports output tokens / wall second. Greedy outputs of the
two configs are compared token for token. Ratios, not absolute speeds, are the result: the machine is shared.

    python benchmarks/bench_batch_spec.py --concurrency 1,4,8 --max-tokens 128 --prompts 8 --rounds 2
    python benchmarks/bench_batch_spec.py --concurrency 1 --max-tokens 16,24 --prompts 10   # short answers
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "bench" / "spec_bench_questions.jsonl"


def load_prompts(path: Path, categories: list[str], per_category: int) -> list[tuple[str, str]]:
    by_cat: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            by_cat.setdefault(d.get("category", ""), []).append(d["turns"][0])
    out = []
    for c in categories:
        out += [(c, q) for q in by_cat.get(c, [])[:per_category]]
    if not out:
        raise SystemExit(f"no prompts of categories {categories} in {path}")
    return out


def run_closed_loop(engine, prompts: list[list[int]], concurrency: int, max_tokens: int, tag: str):
    """All prompts through ``engine`` with at most ``concurrency`` in flight; (wall seconds, outputs by index,
    CPU seconds of this process)."""
    from specdecode.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    pending = list(range(len(prompts)))
    running: set[str] = set()
    outputs: dict[int, list[int]] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    while pending or running:
        while pending and len(running) < concurrency:
            i = pending.pop(0)
            rid = f"{tag}-{i}"
            engine.add_request(rid, None, params, prompt_token_ids=prompts[i])
            running.add(rid)
        for out in engine.step():
            if out.finished:
                running.discard(out.request_id)
                outputs[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)
    return time.perf_counter() - t0, outputs, time.process_time() - c0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,4,8", help="comma-separated C values")
    ap.add_argument("--max-tokens", default="128", help="comma-separated max_tokens values")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per run (per C)")
    ap.add_argument("--categories", default="writing,coding,qa,summarization,translation,math_reasoning")
    ap.add_argument("--dataset", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--rounds", type=int, default=2, help="on/off pairs per setting (order alternates)")
    ap.add_argument("--spec", default=None, help="speculative config JSON for 'on' (default: the preset's)")
    ap.add_argument("--json", type=Path, default=None, help="write all runs here")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: the engine's)")
    ap.add_argument("--recalibrate", action="store_true",
                    help="time the adaptive policy's pass costs again (and replace the cached ones)")
    args = ap.parse_args(argv)

    from specdecode import LLM
    from specdecode.tokenizer import apply_chat_template

    cs = [int(x) for x in args.concurrency.split(",")]
    mts = [int(x) for x in args.max_tokens.split(",")]
    cats = args.categories.split(",")
    per_cat = max(1, -(-args.prompts // len(cats)))
    texts = load_prompts(args.dataset, cats, per_cat)
    # Spread the categories over the prompt list (round robin), then take the first N.
    by_cat: dict[str, list[str]] = {}
    for c, q in texts:
        by_cat.setdefault(c, []).append(q)
    mixed = [q for j in range(per_cat) for c in cats for q in by_cat.get(c, [])[j:j + 1]][:args.prompts]

    llm = LLM(max_num_seqs=max(cs), num_threads=args.threads)
    eng = llm.engine
    spec_on = json.loads(args.spec) if args.spec else eng.config.speculative
    spec_off = None  # plain decoding (the engine's form of {"method": "none"})
    if args.recalibrate:
        eng.set_speculative(spec_on)
        t0 = time.perf_counter()
        eng.calibrate_costs(refresh=True)
        print(f"# recalibrated in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    ids = [eng.input_processor.encode_prompt(apply_chat_template(eng.tokenizer, [{"role": "user", "content": q}])) for q in mixed]
    print(f"# {len(ids)} prompts, lengths {min(map(len, ids))}-{max(map(len, ids))}, "
          f"spec on = {spec_on!r}", file=sys.stderr)
    # Warm-up: both configs once (kernels, the draft's truncated head, the calibration cache).
    for spec in (spec_on, spec_off):
        eng.set_speculative(spec)
        run_closed_loop(eng, ids[:2], 2, 8, "warm")
    rows = []
    for mt in mts:
        for c in cs:
            times = {"on": [], "off": []}
            cpu = {"on": 0.0, "off": 0.0}  # CPU seconds: less moved by other processes than wall time
            tokens = {}
            same = True
            for rnd in range(args.rounds):
                # Waves of C prompts, each run with both configs back to back (order alternating), so that a
                # burst of other work on the machine hits both configs alike.
                outs = {"on": {}, "off": {}}
                spent = {"on": 0.0, "off": 0.0}
                for w in range(0, len(ids), c):
                    order = [("on", spec_on), ("off", spec_off)]
                    if (rnd + w // c) % 2:
                        order.reverse()
                    for name, spec in order:
                        eng.set_speculative(spec)
                        eng.reset_prefix_cache()  # else the second config finds the first's prompts cached
                        dt, out, ct = run_closed_loop(eng, ids[w:w + c], c, mt, f"{name}{c}x{mt}r{rnd}w{w}")
                        spent[name] += dt
                        cpu[name] += ct
                        outs[name].update({w + i: v for i, v in out.items()})
                for name in ("on", "off"):
                    times[name].append(spent[name])
                    tokens[name] = sum(len(v) for v in outs[name].values())
                same &= outs["on"] == outs["off"]
            ratio_per_round = [off / on for on, off in zip(times["on"], times["off"])]
            row = {"concurrency": c, "max_tokens": mt, "prompts": len(ids), "output_tokens": tokens["off"],
                   "tok_s_on": tokens["on"] / statistics.fmean(times["on"]),
                   "tok_s_off": tokens["off"] / statistics.fmean(times["off"]),
                   "ratio_per_round": ratio_per_round,
                   "ratio": statistics.fmean(times["off"]) / statistics.fmean(times["on"]),
                   "cpu_ratio": cpu["off"] / cpu["on"],
                   "identical": same}
            rows.append(row)
            print(f"C={c:2d} max_tokens={mt:3d}: on {row['tok_s_on']:.2f} tok/s, off {row['tok_s_off']:.2f} tok/s,"
                  f" ratio {row['ratio']:.3f} (rounds {', '.join(f'{r:.3f}' for r in ratio_per_round)}),"
                  f" CPU-time ratio {row['cpu_ratio']:.3f},"
                  f" identical={same}", flush=True)
    eng.set_speculative(spec_on)
    print(f"# speculation over the run: {eng.spec_stats}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
