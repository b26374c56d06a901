"""vLLM's serving figures over one run's request records, and their text: one block per run, a sweep table."""
from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from specdecode.bench.serve.client import RequestRecord

PERCENTILES = (50, 90, 99)


# ====================================================================== summary
def _stats_ms(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "median": None, **{f"p{p}": None for p in PERCENTILES}, "n": 0}
    a = np.asarray(xs, dtype=np.float64) * 1000.0
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}, "n": int(a.size)}


def _spec_summary(drafts: float | None, drafted: float, accepted: float, source: str) -> dict | None:
    if not drafted:
        return None
    return {"source": source, "drafts": int(drafts) if drafts is not None else None, "drafted": int(drafted),
            "accepted": int(accepted), "acceptance_rate": accepted / drafted,
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None}


def summarize_run(records: list[RequestRecord], duration: float, metrics: dict | None = None,
                  skipped_turns: int = 0, in_flight: int = 0) -> dict:
    """vLLM's serving figures over one run's records (``metrics``: the /metrics counter deltas)."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_known = all(r.prompt_tokens is not None for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok) if ok and in_known else None
    sources = Counter(r.token_source for r in ok)
    s: dict[str, Any] = {
        "completed": len(ok), "failed": len(failed), "skipped_turns": skipped_turns, "in_flight_cancelled": in_flight,
        "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "output_token_source": dict(sources),
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 and in_tokens is not None
        else None,
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats_ms([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl]),
        "e2el_ms": _stats_ms([r.latency for r in ok if r.latency is not None]),
        "first_error": failed[0].error if failed else None,
        "errors": dict(Counter(r.error for r in failed).most_common(5)),
    }
    rs = [r for r in ok if r.drafted is not None]
    s["spec_decode_responses"] = _spec_summary(
        sum(r.drafts for r in rs) if rs and all(r.drafts is not None for r in rs) else None,
        sum(r.drafted or 0 for r in rs), sum(r.accepted or 0 for r in rs), "responses")
    m = metrics or {}
    s["spec_decode_metrics"] = _spec_summary(m.get("drafts"), m.get("drafted", 0.0), m.get("accepted", 0.0),
                                             "/metrics") if "drafted" in m else None
    s["spec_decode"] = s["spec_decode_metrics"] or s["spec_decode_responses"]
    s["prefix_cache"] = ({"queries": int(m["prefix_queries"]), "hits": int(m.get("prefix_hits", 0)),
                          "hit_rate": m.get("prefix_hits", 0) / m["prefix_queries"]}
                         if m.get("prefix_queries") else None)
    turns = sorted({r.turn for r in ok})
    if len(turns) > 1:
        by_turn = [{"turn": t + 1, **_stats_ms([r.ttft for r in ok if r.turn == t and r.ttft is not None])}
                   for t in turns]
        first = _stats_ms([r.ttft for r in ok if r.turn == 0 and r.ttft is not None])["median"]
        later = _stats_ms([r.ttft for r in ok if r.turn > 0 and r.ttft is not None])["median"]
        s["multi_turn"] = {"ttft_by_turn": by_turn, "first_turn_ttft_median_ms": first,
                           "later_turns_ttft_median_ms": later,
                           "later_over_first": later / first if first and later is not None else None}
    else:
        s["multi_turn"] = None
    return s


# ====================================================================== report
def _f(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def rate_label(rate: float | str) -> str:
    return "inf" if isinstance(rate, str) or math.isinf(rate) else f"{rate:g}"


def _source_line(sources: dict[str, int]) -> str:
    words = {"usage": "server usage", "tokenizer": "--tokenizer count", "chunks": "chunk count (no usage, no "
             "--tokenizer: an approximation)"}
    return ", ".join(f"{words.get(k, k)} ({n})" for k, n in sources.items()) or "-"


def format_run(run: dict) -> str:
    """One run as vLLM's result block."""
    s = run["summary"]
    w = 50
    lines = [" Serving Benchmark Result ".center(w, "=")]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<40} {value}")

    def section(title: str) -> None:
        lines.append(f" {title} ".center(w, "-"))

    row("Max request concurrency:", str(run["max_concurrency"] or "unlimited"))
    row("Request rate (req/s):", rate_label(run["request_rate"]))
    if run.get("interrupted"):
        row("Interrupted:", f"yes (partial; {s['in_flight_cancelled']} in-flight requests dropped)")
    row("Successful requests:", str(s["completed"]))
    row("Failed requests:", str(s["failed"]))
    if s["skipped_turns"]:
        row("Turns not sent (conversation failed):", str(s["skipped_turns"]))
    if not s["completed"]:  # nothing to measure: the failures are the result
        lines.append(f"First error: {s['first_error'] or 'no request was sent'}")
        lines.append("=" * w)
        return "\n".join(lines)
    row("Benchmark duration (s):", _f(s["duration_s"]))
    row("Total input tokens:", "-" if s["total_input_tokens"] is None else str(s["total_input_tokens"]))
    row("Total generated tokens:", str(s["total_output_tokens"]))
    row("Request throughput (req/s):", _f(s["request_throughput"]))
    row("Output token throughput (tok/s):", _f(s["output_throughput"]))
    row("Total token throughput (tok/s):", _f(s["total_token_throughput"]))
    for key, title, short in (("ttft_ms", "Time to First Token", "TTFT"),
                              ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("itl_ms", "Inter-token Latency", "ITL"), ("e2el_ms", "End-to-end Latency", "E2EL")):
        section(title)
        st = s[key]
        row(f"Mean {short} (ms):", _f(st["mean"]))
        row(f"Median {short} (ms):", _f(st["median"]))
        for p in PERCENTILES[1:]:
            row(f"P{p} {short} (ms):", _f(st[f"p{p}"]))
    spec = s["spec_decode"]
    if spec is not None:
        section("Speculative Decoding")
        row("Acceptance rate (%):", _f(100 * spec["acceptance_rate"]))
        row("Acceptance length:", _f(spec["mean_acceptance_length"]))
        row("Drafts:", "-" if spec["drafts"] is None else str(spec["drafts"]))
        row("Draft tokens:", str(spec["drafted"]))
        row("Accepted tokens:", str(spec["accepted"]))
        row("Source:", "server /metrics" if spec["source"] == "/metrics" else "per-response statistics")
    if s["prefix_cache"] is not None:
        section("Prefix Cache")
        row("Hit rate (%):", _f(100 * s["prefix_cache"]["hit_rate"]))
    mt = s["multi_turn"]
    if mt is not None:
        section("Multi-turn TTFT")
        for t in mt["ttft_by_turn"]:
            row(f"Turn {t['turn']} median TTFT (ms) [n={t['n']}]:", _f(t["median"]))
        row("Later turns / first turn (median):", _f(mt["later_over_first"], ".3f"))
    section("Notes")
    lines.append(f"output tokens from: {_source_line(s['output_token_source'])}")
    lines.append("ITL: one gap per text-carrying chunk (a multi-token chunk counts once, as in vLLM)")
    if s["failed"]:
        lines.append(f"{s['failed']} request(s) failed; first error: {s['first_error']}")
    lines.append("=" * w)
    return "\n".join(lines)


def format_sweep(runs: list[dict]) -> str:
    """One row per run (a concurrency or rate sweep), Markdown."""
    head = ("| C | rate | ok | failed | req/s | out tok/s | total tok/s | TTFT p50 / p99 (ms) | TPOT p50 (ms) | "
            "ITL p50 / p99 (ms) | E2E p50 (ms) | accept | later/first TTFT |")
    lines = [head, "|" + "---|" * 13]
    for run in runs:
        s = run["summary"]
        spec = s["spec_decode"]
        mt = s["multi_turn"]
        lines.append(
            f"| {run['max_concurrency'] or 'inf'} | {rate_label(run['request_rate'])} | {s['completed']} | "
            f"{s['failed']} | {_f(s['request_throughput'], '.3f')} | {_f(s['output_throughput'])} | "
            f"{_f(s['total_token_throughput'])} | {_f(s['ttft_ms']['median'], '.0f')} / "
            f"{_f(s['ttft_ms']['p99'], '.0f')} | {_f(s['tpot_ms']['median'], '.1f')} | "
            f"{_f(s['itl_ms']['median'], '.1f')} / {_f(s['itl_ms']['p99'], '.1f')} | "
            f"{_f(s['e2el_ms']['median'], '.0f')} | "
            f"{_f(spec['acceptance_rate'] if spec else None)} | "
            f"{_f(mt['later_over_first'] if mt else None, '.3f')} |")
    return "\n".join(lines)


def format_report(result: dict) -> str:
    m = result["meta"]
    head = (f"server {m['base_url']} ({m['endpoint']}), model {m['model'] or '(not named)'}, dataset "
            f"{m['dataset']} ({m['num_prompts']} {'conversations' if m['multi_turn'] else 'prompts'}), "
            f"max_tokens={m['max_tokens']}, temperature={m['temperature']}")
    parts = [head] + [format_run(r) for r in result["runs"]]
    if len(result["runs"]) > 1:
        parts.append(format_sweep(result["runs"]))
    return "\n\n".join(parts)
