"""Serving benchmark: fixed-concurrency streaming clients against the OpenAI-compatible server.

For each server configuration (by default: no speculation, then the given speculative setup) it starts
``python -m specdecode.entrypoints.openai.api_server`` on a free port, waits for /health, and for each
concurrency level keeps exactly C requests in flight until --num-prompts requests per level are done.
It reports output-token throughput, request throughput, and p50/p99 of TTFT, ITL (gap between successive
streamed chunks that carry text, as vLLM's benchmark measures it) and TPOT ((e2e - TTFT) / (tokens - 1)).

    python benchmarks/bench_serving.py --model TARGET --speculative-model DRAFT --num-speculative-tokens 4
    python benchmarks/bench_serving.py --model TARGET --speculative-model '[ngram]' --num-speculative-tokens 4
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000      # an already running server, one config

With no --model, the server's default pair is used. Prompts come from --dataset (JSONL with "prompt",
"question", "turns" or "instruction" fields) or a small built-in list of coding/chat prompts.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BUILTIN_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a function that reverses a linked list, with a short docstring.",
    "What does the `yield` keyword do in Python? Give an example.",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "Implement binary search in Python and explain its complexity.",
    "Write a bash one-liner that counts the lines of all .py files in a directory tree.",
    "Summarize what speculative decoding is in three sentences.",
    "Write a Python class for a stack with push, pop and peek.",
    "How do I read a CSV file with pandas and compute the mean of one column?",
    "Write a function that merges two sorted lists into one sorted list.",
    "Explain what a race condition is and how a lock prevents it.",
    "Write a Python function to compute the nth Fibonacci number iteratively.",
    "What is the difference between TCP and UDP?",
    "Write a regular expression that matches an email address and explain it.",
    "Write a Python decorator that times how long a function takes.",
]


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    error: str = ""


def load_prompts(path: str | None, n: int) -> list[str]:
    prompts: list[str] = []
    if path:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            d = json.loads(line)
            for key in ("prompt", "question", "instruction", "turns"):
                v = d.get(key)
                if isinstance(v, list) and v:
                    v = v[0]
                if isinstance(v, str) and v.strip():
                    prompts.append(v)
                    break
    prompts = prompts or BUILTIN_PROMPTS
    return [prompts[i % len(prompts)] for i in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, model: str | None, prompt: str, args) -> Result:
    body: dict = {"max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
                  "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if model:
        body["model"] = model
    if args.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    res = Result(ok=False)
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url + path, json=body, timeout=args.timeout) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                text = ""
                for c in chunk.get("choices") or []:
                    text += (c.get("delta") or {}).get("content") or c.get("text") or ""
                if text:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                    spec = chunk.get("spec_decode") or {}
                    res.drafted, res.accepted = spec.get("drafted", 0), spec.get("accepted", 0)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.ok = res.tokens > 0
    return res


async def run_level(url: str, model: str | None, prompts: list[str], concurrency: int,
                    args) -> tuple[list[Result], float]:
    queue = list(prompts)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def worker():
            while queue:
                results.append(await one_request(client, url, model, queue.pop(0), args))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(label: str, c: int, results: list[Result], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl]
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1]
    toks = sum(r.tokens for r in ok)
    drafted, accepted = sum(r.drafted for r in ok), sum(r.accepted for r in ok)
    return {"config": label, "concurrency": c, "requests": len(results), "failed": len(results) - len(ok),
            "output_tok_s": toks / wall if wall else 0.0, "req_s": len(ok) / wall if wall else 0.0,
            "ttft_p50_ms": 1e3 * pct([r.ttft for r in ok], 0.5), "ttft_p99_ms": 1e3 * pct([r.ttft for r in ok], 0.99),
            "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99),
            "tpot_p50_ms": 1e3 * pct(tpot, 0.5), "tpot_p99_ms": 1e3 * pct(tpot, 0.99),
            "acceptance": accepted / drafted if drafted else None, "output_tokens": toks, "wall_s": wall,
            "errors": sorted({r.error for r in results if r.error})[:3]}


def table(rows: list[dict]) -> str:
    head = ("| config | C | reqs | out tok/s | req/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
            "TPOT p50 / p99 (ms) | accept |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        fail = f" ({r['failed']} failed)" if r["failed"] else ""
        lines.append(f"| {r['config']} | {r['concurrency']} | {r['requests']}{fail} | {r['output_tok_s']:.2f} | "
                     f"{r['req_s']:.3f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                     f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | "
                     f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | "
                     f"{acc} |")
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch(server_args: list[str], startup_timeout: float, command: list[str] | None = None):
    """Start a server (``command``, by default our OpenAI server module, plus --port and ``server_args``), wait
    until /health answers, yield its URL, and stop it afterwards."""
    with launch_process(server_args, startup_timeout, command) as (url, _):
        yield url


@contextlib.contextmanager
def launch_process(server_args: list[str], startup_timeout: float, command: list[str] | None = None):
    """``launch``, yielding (URL, the server's process)."""
    port = free_port()
    base = command or [sys.executable, "-m", "specdecode.entrypoints.openai.api_server"]
    cmd = [*base, "--port", str(port), *server_args]
    print(f"# starting: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"server exited with code {proc.returncode} during startup")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.time() > deadline:
                raise SystemExit("server did not become healthy in time")
            time.sleep(0.5)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_url(label: str, url: str, args) -> list[dict]:
    model = args.served_model_name
    rows = []
    # warm-up: one short request so first-call costs (allocations, kernel setup) stay out of the numbers
    warm = argparse.Namespace(**{**vars(args), "max_tokens": 4})
    asyncio.run(run_level(url, model, load_prompts(args.dataset, 1), 1, warm))
    for c in args.concurrency:
        n = max(c, 2, args.num_prompts if args.num_prompts else c * args.prompts_per_client)
        prompts = load_prompts(args.dataset, n)
        results, wall = asyncio.run(run_level(url, model, prompts, c, args))
        row = summarize(label, c, results, wall)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="Benchmark this running server instead of launching servers.")
    p.add_argument("--model", default=None, help="Target model for launched servers (default: the default pair).")
    p.add_argument("--speculative-model", default=None, help="Draft path or '[ngram]' (default: the default draft "
                                                             "when --model is not given, else [ngram]).")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--configs", default="nospec,spec", help="Which launched configs to run: nospec, spec.")
    p.add_argument("--server-arg", action="append", default=[], help="Extra flag for launched servers "
                                                                     "(repeatable, e.g. --server-arg=--dtype=float32).")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--concurrency", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--num-prompts", type=int, default=0, help="Requests per level (default: 2 per client).")
    p.add_argument("--prompts-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="Always generate --max-tokens tokens.")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--dataset", default=None, help="JSONL prompts (prompt/question/turns/instruction field).")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--output", default=None, help="Also write the rows as JSON here.")
    args = p.parse_args()

    rows: list[dict] = []
    if args.url:
        rows += bench_url("server", args.url.rstrip("/"), args)
    else:
        base = [*args.server_arg, "--max-num-seqs", str(max(args.concurrency))]
        if args.model:
            base += ["--model", args.model]
        if args.served_model_name:
            base += ["--served-model-name", args.served_model_name]
        draft = args.speculative_model or ("default" if args.model is None else "[ngram]")
        configs = {
            # with no --model the server picks the default pair; a lone target needs the default target path
            "nospec": base + (["--model", "default"] if args.model is None else []),
            "spec": base + ["--speculative-model", draft, "--num-speculative-tokens", str(args.num_speculative_tokens)],
        }
        for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
            label = "no spec" if name == "nospec" else f"spec {draft} k={args.num_speculative_tokens}"
            with launch(configs[name], args.startup_timeout) as url:
                rows += bench_url(label, url, args)
    print(table(rows))
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
