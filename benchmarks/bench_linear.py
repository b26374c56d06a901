"""Benchmark the row-invariant linear kernel against torch's F.linear (fp32 weights, same run).

    python benchmarks/bench_linear.py                 # all shapes, M in 1,2,4,5,8,16, 2 threads
    python benchmarks/bench_linear.py --shapes 8960x1536 --ms 1,5 --threads 1
    python benchmarks/bench_linear.py --hot           # reuse one weight copy (may sit in L3)

By default each measurement cycles through enough copies of the weight that they cannot all stay in
the last-level cache, as in real decoding where every layer's weights stream from DRAM.

Columns: times in ms (median per call, or --stat min); ``fp32/ref`` = rowinv fp32 / F.linear at the same M;
``ref1/int8`` = F.linear at M=1 / int8 at this M (speed-up over plain fp32 decoding);
``int8/int8@1`` = int8 at this M / int8 at M=1 (cost of verifying M tokens vs decoding one).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specdecode.layers import kernels

DEFAULT_SHAPES = "1536x1536,8960x1536,1536x8960,151936x1536"
LLC_DEFEAT_BYTES = 96 << 20


_clock = time.perf_counter


def _time(fn, copies, min_time: float, stat: str = "median", min_iters: int = 5) -> float:
    for i in range(min(3, len(copies)) + 1):  # warm up
        fn(copies[i % len(copies)])
    times = []
    start = time.perf_counter()
    i = 0
    while i < min_iters or time.perf_counter() - start < min_time:
        c = copies[i % len(copies)]
        t0 = _clock()
        fn(c)
        times.append(_clock() - t0)
        i += 1
    return (min(times) if stat == "min" else statistics.median(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma separated NxK list")
    ap.add_argument("--ms", default="1,2,4,5,8,16", help="comma separated row counts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--formats", default="fp32,bf16,int8")
    ap.add_argument("--min-time", type=float, default=0.25, help="seconds per measurement")
    ap.add_argument("--hot", action="store_true", help="do not rotate weight copies")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="per-call statistic (min is more robust on a shared, noisy machine)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread = CPU time of the calling thread (only with --threads 1): ignores time "
                         "spent descheduled when other jobs share the machine")
    args = ap.parse_args()
    if args.clock == "thread":
        if args.threads != 1:
            ap.error("--clock thread needs --threads 1")
        global _clock
        _clock = time.thread_time

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    info = kernels.kernel_info()
    fmts = [f for f in args.formats.split(",") if f]
    ms = [int(m) for m in args.ms.split(",")]
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, kernel={info}, "
          f"{'hot (single copy)' if args.hot else 'cold (rotating weight copies)'}, {args.stat} of per-call {args.clock} times")

    hdr = f"{'N x K':>13} {'M':>3} {'F.linear':>9}" + "".join(f" {f:>8}" for f in fmts)
    hdr += f" {'fp32/ref':>9} {'ref1/int8':>10} {'int8/int8@1':>12}"
    print(hdr)
    print("-" * len(hdr))
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.lower().split("x"))
        smallest = N * K * (1 if "int8" in fmts else 2 if "bf16" in fmts else 4)
        ncopies = 1 if args.hot else max(1, -(-LLC_DEFEAT_BYTES // smallest))
        weights = [torch.randn(N, K) * 0.02 for _ in range(ncopies)]
        packed = {f: [kernels.pack_linear(w, f) for w in weights] for f in fmts}
        ref1 = None
        int8_1 = None
        for M in ms:
            x = torch.randn(M, K)
            t_ref = _time(lambda w: F.linear(x, w), weights, args.min_time, args.stat)
            res = {f: _time(lambda p: kernels.rowinv_linear(x, p), packed[f], args.min_time, args.stat) for f in fmts}
            if M == ms[0]:
                ref1 = t_ref
                int8_1 = res.get("int8")
            line = f"{shape:>13} {M:>3} {t_ref:9.3f}" + "".join(f" {res[f]:8.3f}" for f in fmts)
            line += f" {res['fp32'] / t_ref:9.2f}" if "fp32" in res else f" {'-':>9}"
            if "int8" in res:
                line += f" {ref1 / res['int8']:10.2f} {res['int8'] / int8_1:12.2f}"
            print(line, flush=True)
        del weights, packed


if __name__ == "__main__":
    main()
