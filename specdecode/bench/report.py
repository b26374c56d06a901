"""Aggregates benchmark runs (per category and overall) and formats them as terminal tables.

Definitions (vLLM's):
  decode tokens/s      tokens after the first / time from the first token to the last (prefill excluded),
                       summed over the prompts of a group before dividing
  speedup              decode tokens/s of a config / decode tokens/s of the baseline on the same prompts
  acceptance rate      accepted draft tokens / drafted tokens
  mean accept. length  1 + accepted / drafts (tokens emitted per target verification pass)
  per-position rate    drafts whose i-th token was accepted / drafts
  TTFT                 request added -> first token (the target's prefill)
  with draft prefill   per output length: the baseline's time after the first token / a config's, its draft
                       prefill included (the one-off work that short answers may not pay back); the target's
                       prefill is the same work in every config and is left out, as its timing noise would
                       swamp short answers
  draft prefill        the draft model's pass over the prompt; timed on its own and excluded from decode
                       time (it belongs to the prefill phase, as in vLLM); end-to-end latency includes it
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from specdecode.speculative.metrics import SpecDecodeStats

if TYPE_CHECKING:
    from specdecode.bench.runner import BenchConfig, PromptRun

OVERALL = "overall"
# Output lengths (the baseline's tokens for a prompt) the per-length table groups by: a short answer pays for
# speculation's one-off work (a draft prefill, probes) over few tokens, so it is where speculation can lose.
LENGTH_BUCKETS: tuple[tuple[int, int | None], ...] = ((1, 7), (8, 32), (33, 96), (97, None))


def _bucket_label(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi}" if hi is not None else f"{lo}+"


def _per_length(runs: list["PromptRun"], group) -> dict[str, dict]:
    """Runs grouped by their prompt's baseline output length (LENGTH_BUCKETS), each group as ``group`` makes
    it, plus each config's speedup over the baseline with its draft prefill counted (``speedup_with_prefill``)
    on that group's prompts."""
    length = {r.prompt_id: r.num_output_tokens for r in runs if r.config == "baseline"}
    out = {}
    for lo, hi in LENGTH_BUCKETS:
        ids = {p for p, n in length.items() if n >= lo and (hi is None or n <= hi)}
        if not ids:
            continue
        rs = [r for r in runs if r.prompt_id in ids]
        g = group(rs)
        after = {name: sum(r.decode_time_s + r.draft_prefill_s for r in rs if r.config == name) for name in g}
        for name, m in g.items():
            base, own = after.get("baseline"), after[name]
            m["speedup_with_prefill"] = base / own if base and own else None
        out[_bucket_label(lo, hi)] = g
    return out


def _aggregate(runs: list["PromptRun"], cfg: "BenchConfig", model_mb: float | None,
               bandwidth_gbps: float | None = None) -> dict:
    dec_tokens = sum(max(0, r.num_output_tokens - 1) for r in runs)
    dec_time = sum(r.decode_time_s for r in runs)
    spec = SpecDecodeStats()
    for r in runs:
        spec.merge(r.spec)
    ttfts = [r.ttft_s for r in runs]
    mism = [r for r in runs if r.match_baseline is False]
    speculative = cfg.method is not None
    weight_gbps = sum(r.weight_bytes_read for r in runs) / dec_time / 1e9 if dec_time > 0 else None
    modeled = [r.modeled_decode_s for r in runs]
    modeled_time = sum(modeled) if runs and None not in modeled else None
    return {
        "config": cfg.name, "method": cfg.method or "none", "k": cfg.k,
        "num_prompts": len(runs),
        "output_tokens": sum(r.num_output_tokens for r in runs),
        "decode_tokens": dec_tokens,
        "decode_time_s": dec_time,
        "decode_tokens_per_s": dec_tokens / dec_time if dec_time > 0 else None,
        "speedup": None,  # filled in against the baseline
        # the same from the passes' calibrated costs (bench.runner.modeled_seconds): no clock noise
        "modeled_decode_tokens_per_s": dec_tokens / modeled_time if modeled_time else None,
        "acceptance_rate": spec.acceptance_rate if speculative else None,
        "mean_acceptance_length": spec.mean_acceptance_length if speculative else None,
        "per_position_acceptance": spec.per_position_acceptance_rate if speculative else [],
        "num_drafts": spec.num_drafts,
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "draft_prefill_mean_s": statistics.fmean(r.draft_prefill_s for r in runs) if runs else None,
        "e2e_latency_mean_s": statistics.fmean(r.e2e_s for r in runs) if runs else None,
        "inter_token_latency_ms": 1000 * dec_time / dec_tokens if dec_tokens else None,
        "weight_read_gbps": weight_gbps,
        "bandwidth_utilization": weight_gbps / bandwidth_gbps if weight_gbps is not None and bandwidth_gbps else None,
        "peak_rss_mb": max((r.peak_rss_mb for r in runs), default=None),
        "model_memory_mb": model_mb,
        "greedy_mismatches": len(mism),
        "outputs_identical": not mism,
        "first_diff_position": min((r.first_diff_position for r in mism), default=None),
        "mismatched_prompts": [{"prompt_id": r.prompt_id, "category": r.category,
                                "first_diff_position": r.first_diff_position} for r in mism],
    }


def _with_speedup(group: dict[str, dict]) -> dict[str, dict]:
    base = group.get("baseline", {}).get("decode_tokens_per_s")
    for m in group.values():
        v = m["decode_tokens_per_s"]
        m["speedup"] = v / base if (v is not None and base) else None
    return group


def summarize(runs: list["PromptRun"], configs: list["BenchConfig"], categories: list[str], meta: dict,
              model_mb: dict | None = None) -> dict:
    """The full result: meta, configs, overall and per-category metrics per config, and every run."""
    model_mb = model_mb or {}
    used_cats = [c for c in categories if any(r.category == c for r in runs)]

    def group(rs: list) -> dict[str, dict]:
        return _with_speedup({c.name: _aggregate([r for r in rs if r.config == c.name], c, model_mb.get(c.method),
                                                 meta.get("memory_bandwidth_gbps"))
                              for c in configs})

    return {
        "meta": meta,
        "configs": [{"name": c.name, "method": c.method or "none", "k": c.k, "draft_p_min": c.p_min,
                     "draft_confidence": c.confidence, "draft_vocab_size": c.vocab, "lookup_k": c.lookup_k}
                    for c in configs],
        "categories": used_cats,
        "overall": group(runs),
        "per_category": {cat: group([r for r in runs if r.category == cat]) for cat in used_cats},
        "per_length": _per_length(runs, group),
        "runs": [r.as_dict() for r in runs],
    }


# ---- terminal tables ----
def _fmt(v, spec: str = ".2f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    right = right if right is not None else set(range(1, len(headers)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in rows]
    return "\n".join(out)


def _match(m: dict, greedy: bool) -> str:
    if m["config"] == "baseline":
        return "ref"
    if m["greedy_mismatches"] == 0:
        return "identical" if greedy else "same"
    return f"{m['greedy_mismatches']} differ (pos {m['first_diff_position']})"


def _row(label: str, m: dict, greedy: bool) -> list[str]:
    return [label, m["config"], str(m["num_prompts"]), _fmt(m["decode_tokens_per_s"]),
            _fmt(m["speedup"], ".2f") + ("x" if m["speedup"] is not None else ""),
            _fmt(None if m["acceptance_rate"] is None else 100 * m["acceptance_rate"], ".1f"),
            _fmt(m["mean_acceptance_length"]),
            _fmt(None if m["ttft_mean_s"] is None else 1000 * m["ttft_mean_s"], ".0f"),
            _fmt(m["weight_read_gbps"], ".1f") + (f" ({100 * m['bandwidth_utilization']:.0f}%)"
                                                  if m.get("bandwidth_utilization") is not None else ""),
            _fmt(m["peak_rss_mb"], ".0f"), _fmt(m["model_memory_mb"], ".0f"), _match(m, greedy)]


_HEADERS = ["category", "config", "n", "decode tok/s", "speedup", "accept %", "mean len", "TTFT ms",
            "weight GB/s (of peak)", "peak RSS MB", "model MB", "greedy vs baseline"]


def long_context_rows(result: dict) -> list[dict]:
    """Per prompt length (the long-context dataset's categories) and config: mean prompt tokens, TTFT, decode
    tokens/s with the draft's prefill counted, end-to-end seconds, and the end-to-end rate against the
    baseline's on the same prompts (> 1: faster than speculation off)."""
    out = []
    for cat in result["categories"]:
        runs = [r for r in result["runs"] if r["category"] == cat]
        e2e: dict[str, float] = {}
        for name in result["per_category"][cat]:
            rs = [r for r in runs if r["config"] == name]
            if not rs:
                continue
            dec = sum(max(0, r["output_tokens"] - 1) for r in rs)
            dec_s = sum(r["decode_time_s"] + r["draft_prefill_s"] for r in rs)
            e2e[name] = sum(r["e2e_latency_s"] for r in rs)
            out.append({"length": cat, "config": name, "num_prompts": len(rs),
                        "prompt_tokens": statistics.fmean(r["prompt_tokens"] for r in rs),
                        "ttft_s": statistics.fmean(r["ttft_s"] for r in rs),
                        "decode_tokens_per_s": dec / dec_s if dec_s > 0 else None,
                        "e2e_s": e2e[name] / len(rs),
                        "draft_prefill_s": statistics.fmean(r["draft_prefill_s"] for r in rs),
                        "identical": all(r["match_baseline"] is not False for r in rs)})
        for row in out:
            if row["length"] == cat:
                base = e2e.get("baseline")
                row["e2e_vs_plain"] = base / e2e[row["config"]] if base and e2e[row["config"]] else None
    return out


def _long_table(result: dict) -> str:
    rows = [[r["length"], r["config"], str(r["num_prompts"]), _fmt(r["prompt_tokens"], ".0f"), _fmt(r["ttft_s"]),
             _fmt(r["decode_tokens_per_s"]), _fmt(r["draft_prefill_s"]), _fmt(r["e2e_s"]),
             _fmt(r["e2e_vs_plain"]) + ("x" if r["e2e_vs_plain"] is not None else ""),
             "yes" if r["identical"] else "NO"] for r in long_context_rows(result)]
    return ("Per prompt length (decode tok/s counts the draft's prefill; e2e vs plain = the baseline's end-to-end "
            "time / this config's)\n"
            + _table(["length", "config", "n", "prompt tok", "TTFT s", "decode tok/s", "draft prefill s", "e2e s",
                      "e2e vs plain", "greedy same"], rows, right=set(range(2, 9))))


def format_report(result: dict) -> str:
    meta = result["meta"]
    greedy = meta.get("greedy", True)
    parts = []
    if meta.get("dataset_format") == "long-context":
        parts.append(_long_table(result))
    rows = []
    for cat in result["categories"]:
        for m in result["per_category"][cat].values():
            rows.append(_row(cat, m, greedy))
    if len(result["categories"]) > 1:
        parts.append("Per category\n" + _table(_HEADERS, rows, right=set(range(2, 11))))
    rows = []
    for m in result["overall"].values():
        rows.append(_row(OVERALL, m, greedy))
    parts.append("Overall\n" + _table(_HEADERS, rows, right=set(range(2, 11))))
    lengths = result.get("per_length") or {}
    if lengths:
        rows = [[label, m["config"], str(m["num_prompts"]), _fmt(m["decode_tokens_per_s"]),
                 _fmt(m["speedup"]) + ("x" if m["speedup"] is not None else ""),
                 _fmt(m["draft_prefill_mean_s"], ".3f"),
                 _fmt(m["speedup_with_prefill"]) + ("x" if m["speedup_with_prefill"] is not None else "")]
                for label, g in lengths.items() for m in g.values()]
        parts.append("Per output length (the baseline's tokens per prompt)\n"
                     + _table(["output tokens", "config", "n", "decode tok/s", "speedup", "draft prefill s",
                               "with draft prefill"], rows, right=set(range(2, 7))))
    spec_cfgs = [m for m in result["overall"].values() if m["per_position_acceptance"]]
    if spec_cfgs:
        kmax = max(len(m["per_position_acceptance"]) for m in spec_cfgs)
        pr = [[m["config"]] + [_fmt(100 * m["per_position_acceptance"][i], ".0f") + "%"
                               if i < len(m["per_position_acceptance"]) else "" for i in range(kmax)]
              for m in spec_cfgs]
        parts.append("Acceptance per draft position (accepted at position i / drafts)\n"
                     + _table(["config"] + [f"pos {i + 1}" for i in range(kmax)], pr))
    head = (f"target: {meta.get('target')}   draft: {meta.get('draft') or '-'}\n"
            f"dataset: {meta.get('dataset')} ({meta.get('dataset_format')}, {meta.get('num_prompts_used')} prompts)"
            f"   max_tokens: {meta.get('max_tokens')}   "
            + ("greedy" if greedy else f"temperature {meta.get('temperature')}")
            + f"   threads: {meta.get('threads')}   load: {_fmt(meta.get('load_time_s'), '.1f')} s"
            + f"\nmemory bandwidth (sum of a 1 GiB buffer): {_fmt(meta.get('memory_bandwidth_gbps'), '.1f')} GB/s;"
            " weight GB/s = linear weights streamed by decode/verify passes / decode time"
            + (f"\nCPU kernel: {meta['cpu_kernel']}" if meta.get("cpu_kernel") else ""))
    return head + "\n\n" + "\n\n".join(parts)


def format_verify_cost(rows: list[dict], prefill_len: int) -> str:
    table = _table(["query tokens", "median ms", "min ms", "relative to 1", "ms / token"],
                   [[str(r["tokens"]), _fmt(r["ms_median"]), _fmt(r["ms_min"]), _fmt(r["relative"], ".2f") + "x",
                     _fmt(r["ms_median"] / r["tokens"])] for r in rows])
    return f"Target forward-pass cost after a {prefill_len}-token prefill\n" + table
