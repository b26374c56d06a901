"""KV cache footprint and decode / verify step times of the default pair, one process per run.

    python benchmarks/bench_kv_cache.py [--ctx 512 1536] [--kv-cache-dtype auto|float16|bfloat16|float32]

For each model (target w8a8, draft w4a8 by default) it builds a 1-slot runner at --max-model-len, prefills
--ctx tokens and times, with the median of --reps passes: a decode step (1 row) and, for the target, a verify
step (k + 1 rows). Every pass writes the same positions, as a rolled-back request would. It prints KV bytes
per token (allocated) and the process RSS. Runs with code versions that predate kv_cache_dtype too, so an old
checkout can be timed the same way (alternate old and new processes and compare ratios).
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

import torch


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def kv_bytes(runner) -> int:
    """Allocated bytes of every layer's KV storage (the KVCache object's, or the older per-module tensors)."""
    kv = getattr(runner, "kv_cache", None)
    if kv is not None:
        return kv.nbytes
    from specdecode.layers.attention import Attention
    n = 0
    for m in runner.model.modules():
        if isinstance(m, Attention):
            for name in ("k_cache", "v_cache", "kt_cache"):
                t = getattr(m, name, None)
                if t is not None:
                    n += t.numel() * t.element_size()
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, nargs="+", default=[512])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--k", type=int, default=4, help="drafts per verify step (k + 1 rows)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("-q", "--quantization", default="w8a8")
    ap.add_argument("-qd", "--draft-quantization", default="w4a8")
    ap.add_argument("--kv-cache-dtype", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--roles", nargs="+", default=["target", "draft"])
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from specdecode.engine.model_runner import ModelRunner
    from specdecode.models.loader import load_model
    from specdecode.models.resolve import resolve_model

    out: dict = {"label": args.label, "kv_cache_dtype": args.kv_cache_dtype}
    g = torch.Generator().manual_seed(0)
    for role in args.roles:
        q = args.quantization if role == "target" else args.draft_quantization
        loaded = load_model(resolve_model(None, role), "float32", "cpu", args.max_model_len, None if q == "none" else q)
        kw = {}
        if args.kv_cache_dtype and "kv_cache_dtype" in inspect.signature(ModelRunner).parameters:
            kw["kv_cache_dtype"] = args.kv_cache_dtype
        before = rss_mb()
        runner = ModelRunner(loaded, 1, args.max_model_len, "cpu", **kw)
        res: dict = {"kv_bytes_per_token": kv_bytes(runner) // args.max_model_len,
                     "kv_allocated_mb": kv_bytes(runner) / 2**20, "rss_added_by_runner_mb": rss_mb() - before}
        V = runner.vocab_size
        for ctx in args.ctx:
            ids = torch.randint(100, min(V, 30000), (ctx + args.k + 1,), generator=g).tolist()
            runner.prefill(0, ids[:ctx])
            res[f"rss_after_prefill_{ctx}_mb"] = rss_mb()
            kinds = {"decode": (ids[ctx:ctx + 1], False)}
            if role == "target":
                kinds["verify"] = (ids[ctx:ctx + args.k + 1], True)
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(2):  # warm-up
                for name, (toks, all_logits) in kinds.items():
                    runner.forward_rows([(0, ctx, toks)], all_logits=all_logits)
            for _ in range(args.reps):  # interleaved, so drift hits both kinds alike
                for name, (toks, all_logits) in kinds.items():
                    t0 = time.perf_counter()
                    runner.forward_rows([(0, ctx, toks)], all_logits=all_logits)
                    times[name].append(time.perf_counter() - t0)
            for name, ts in times.items():
                res[f"{name}_ms_ctx{ctx}"] = round(1e3 * statistics.median(ts), 2)
        res["rss_mb"] = rss_mb()
        out[role] = res
        del runner, loaded
    print(json.dumps(out))


if __name__ == "__main__":
    main()
