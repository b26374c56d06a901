"""What Ray Serve adds to each request, measured where the model costs next to nothing.

    python benchmarks/bench_ray_overhead.py [--model DIR] [--requests 50] [--max-tokens 8] [--threads 1]

Starts `specdecode serve` (one process) and `specdecode serve --ray --num-replicas 1` in turn on the same
model (by default a tiny random model built here, so that a forward pass takes a millisecond or two and what
is left is the serving path), sends the same short requests one at a time (C = 1) and reports, per server, the
p50 and p90 of the non-streaming request latency, of the streaming time to first token and of the gaps between
stream chunks. The difference between the two servers is Ray's per-request routing overhead: Ray's HTTP proxy,
our ingress deployment and the hop to the engine replica.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_serving import launch  # noqa: E402
PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "Speculative decoding drafts"]


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] * 1000


def _measure(url: str, n: int, max_tokens: int) -> dict:
    client = httpx.Client(timeout=120)
    model = client.get(url + "/v1/models").json()["data"][0]["id"]
    body = lambda i, stream: {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens,  # noqa: E731
                              "temperature": 0, "stream": stream}
    for i in range(3):  # warm-up: kernels, connections, Ray's handles
        client.post(url + "/v1/completions", json=body(i, False)).raise_for_status()
    latency, ttft, gaps, texts = [], [], [], []
    for i in range(n):
        t0 = time.perf_counter()
        r = client.post(url + "/v1/completions", json=body(i, False))
        latency.append(time.perf_counter() - t0)
        r.raise_for_status()
        texts.append(r.json()["choices"][0]["text"])
        t0 = time.perf_counter()
        last = None
        with client.stream("POST", url + "/v1/completions", json=body(i, True)) as s:
            for line in s.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft.append(now - t0)
                else:
                    gaps.append(now - last)
                last = now
    return {"latency_ms": {"p50": _pct(latency, 0.5), "p90": _pct(latency, 0.9)},
            "ttft_ms": {"p50": _pct(ttft, 0.5), "p90": _pct(ttft, 0.9)},
            "chunk_gap_ms": {"p50": _pct(gaps, 0.5), "p90": _pct(gaps, 0.9)} if gaps else None,
            "texts": texts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model to serve (default: a tiny random model built here)")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--result-json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(ROOT / "tests"))
            from tiny import build_model
            model = str(build_model("llama", Path(tmp) / "tiny"))
        serve = [sys.executable, "-m", "specdecode", "serve", model]
        common = ["--max-num-seqs", "4", "--threads", str(args.threads), "--spec-type", "ngram",
                  "--max-model-len", "1024"]
        results = {}
        for name, extra in (("single", []), ("ray", ["--ray", "--num-replicas", "1", "--num-cpus-per-replica",
                                                     str(args.threads)])):
            t0 = time.perf_counter()
            with launch(common + extra, 600, command=serve) as url:
                results[name] = dict(_measure(url, args.requests, args.max_tokens), load_s=time.perf_counter() - t0)
        same = results["single"].pop("texts") == results["ray"].pop("texts")
        for name, r in results.items():
            gap = r["chunk_gap_ms"] or {"p50": float("nan"), "p90": float("nan")}
            print(f"{name:>6}: latency p50 {r['latency_ms']['p50']:7.1f} ms p90 {r['latency_ms']['p90']:7.1f} | "
                  f"TTFT p50 {r['ttft_ms']['p50']:7.1f} p90 {r['ttft_ms']['p90']:7.1f} | "
                  f"chunk gap p50 {gap['p50']:6.1f} p90 {gap['p90']:6.1f} ms")
        for key in ("latency_ms", "ttft_ms"):
            print(f"added by Ray, {key[:-3]} p50: {results['ray'][key]['p50'] - results['single'][key]['p50']:+.1f} ms")
        print(f"same greedy texts: {same}")
        if args.result_json:
            Path(args.result_json).write_text(json.dumps(dict(results, same_texts=same), indent=1))


if __name__ == "__main__":
    main()
