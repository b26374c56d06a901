"""Does the server's memory plateau under disconnect storms? Each storm opens many streaming chat requests at
once, reads a few chunks of each and drops the connections; after the server reports no request running or
waiting, the server process's resident set (VmRSS) is read. Memory that grows with every storm is a leak; memory
that grows while the KV cache's blocks are touched for the first time and then stays flat is the cache filling.

    python benchmarks/bench_disconnect_rss.py                          # the default model pair, 12 storms of 32
    python benchmarks/bench_disconnect_rss.py --storms 20 --streams 64 -- --model some.gguf --spec-type ngram
Arguments after ``--`` go to ``specdecode serve``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks")]
from bench_serving import BUILTIN_PROMPTS, launch_process  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def gauge(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def one_stream(http: httpx.AsyncClient, url: str, prompt: str, chunks: int) -> int:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 256, "stream": True,
            "temperature": 0.8}
    seen = 0
    with contextlib.suppress(httpx.HTTPError):
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= chunks:
                        break  # leaving the block closes the connection mid-stream
    return seen


async def storm(url: str, prompts: list[str], chunks: int) -> int:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        return sum(await asyncio.gather(*(one_stream(http, url, p, chunks) for p in prompts)))


def wait_idle(url: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        if gauge(text, "vllm:num_requests_running") == 0 and gauge(text, "vllm:num_requests_waiting") == 0:
            return
        time.sleep(0.2)
    raise SystemExit("the server still had requests in flight long after the storm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--storms", type=int, default=12)
    ap.add_argument("--streams", type=int, default=32, help="concurrent streams per storm")
    ap.add_argument("--chunks", type=int, default=3, help="chunks read from each stream before dropping it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("serve_args", nargs="*", help="after --: arguments of specdecode serve")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with launch_process(args.serve_args, 900, [sys.executable, "-m", "specdecode", "serve"]) as (url, proc):
        before = rss_mib(proc.pid)
        print(f"{'storm':>5} {'chunks':>7} {'seconds':>8} {'RSS MiB':>8} {'delta':>7}")
        print(f"{0:>5} {'':>7} {'':>8} {before:8.1f} {'':>7}")
        last = before
        half = args.storms // 2
        at_half = before
        for i in range(1, args.storms + 1):
            # distinct prompts each storm, so that the prefix cache keeps taking new blocks
            prompts = [f"[{rng.randrange(10**9)}] {rng.choice(BUILTIN_PROMPTS)}" for _ in range(args.streams)]
            t0 = time.perf_counter()
            seen = asyncio.run(storm(url, prompts, args.chunks))
            wait_idle(url)
            now = rss_mib(proc.pid)
            print(f"{i:>5} {seen:>7} {time.perf_counter() - t0:8.1f} {now:8.1f} {now - last:+7.1f}", flush=True)
            last = now
            if i == half:
                at_half = now
        print(f"# {last - before:+.1f} MiB over {args.storms} storms, {last - at_half:+.1f} MiB over the last "
              f"{args.storms - half}")


if __name__ == "__main__":
    main()
