"""Prefix caching on a real server: the same long prompt twice, and a multi-turn chat.

Starts ``specdecode serve`` (the default pair unless --model/--draft are given), then
  1. sends one ~N-token prompt twice (streaming, greedy): TTFT of each, and whether the outputs are identical;
  2. replays a 4-turn chat whose history grows each turn: each turn's TTFT, against a cold prefill of the same
     history (the same messages behind a fresh nonce, so that no block of it is cached).
Prints a table and writes JSON.

    python benchmarks/bench_prefix_cache.py --tokens 2000 --out prefix.json
    python benchmarks/bench_prefix_cache.py --serve-args "--no-enable-prefix-caching"   # the baseline
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import uuid

import httpx

FILLER = ("The service keeps a ledger of every order: its id, the customer, the items with quantities and unit "
          "prices, the shipping address, the state (placed, paid, packed, shipped, delivered or returned) and a "
          "free-text note. Refunds reference the original order and never exceed what was paid. ")
QUESTIONS = ["Summarise the rules above in three bullet points.",
             "Which states can an order move to after 'paid'?",
             "Write a Python dataclass for an order.",
             "Add a method that computes the order's total."]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = _port()
    cmd = [sys.executable, "-m", "specdecode", "serve", "--port", str(port), "--max-num-seqs", "1",
           *shlex.split(args.serve_args)]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start in 600 s")


def chat(url: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """(TTFT seconds, answer) of one streaming greedy chat request."""
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, parts = None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(delta)
    return (ttft if ttft is not None else float("nan")), "".join(parts)


def system_prompt(tokens: int, nonce: str = "") -> str:
    words = int(tokens * 0.72)  # about 1.4 tokens per English word with this filler
    text = (FILLER * (words // len(FILLER.split()) + 1)).split()[:words]
    return (f"[{nonce}] " if nonce else "") + " ".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000, help="approximate prompt length of the repeated prompt")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--serve-args", default="", help="extra flags for specdecode serve")
    ap.add_argument("--url", default=None, help="use a running server instead of starting one")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        sys_msg = {"role": "system", "content": system_prompt(args.tokens)}
        q = [sys_msg, {"role": "user", "content": "What does a refund reference?"}]
        t1, a1 = chat(url, q, args.max_tokens)
        t2, a2 = chat(url, q, args.max_tokens)
        repeat = {"ttft_first": t1, "ttft_second": t2, "ratio": t2 / t1, "identical": a1 == a2}
        print(f"repeat ~{args.tokens} tokens: TTFT {t1:.2f} s then {t2:.2f} s ({t2 / t1:.1%}); "
              f"identical outputs: {a1 == a2}")
        history = [{"role": "system", "content": system_prompt(args.tokens // 2)}]
        turns = []
        for i, question in enumerate(QUESTIONS):
            history.append({"role": "user", "content": question})
            cold_history = [{"role": "system", "content": f"[{uuid.uuid4().hex[:8]}] " + history[0]["content"]}]
            cold, _ = chat(url, cold_history + history[1:], args.max_tokens)
            warm, answer = chat(url, history, args.max_tokens)
            history.append({"role": "assistant", "content": answer})
            turns.append({"turn": i + 1, "ttft": warm, "cold_ttft": cold, "ratio": warm / cold})
            print(f"turn {i + 1}: TTFT {warm:.2f} s, cold prefill of the same history {cold:.2f} s "
                  f"({warm / cold:.1%})")
        result = {"repeat": repeat, "multi_turn": turns, "serve_args": args.serve_args}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
