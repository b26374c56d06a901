"""PNG charts of a ``bench`` or ``bench serve`` result (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

_COLORS = {"ngram": "tab:orange", "draft": "tab:blue"}


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _spec_configs(result: dict) -> list[dict]:
    return [c for c in result["configs"] if c["method"] != "none"]


def _config_colors(plt, cfgs: list[dict]) -> dict[str, tuple]:
    """One colour family per method (ngram oranges, draft blues), darker for larger k."""
    maps = {"ngram": plt.get_cmap("Oranges"), "draft": plt.get_cmap("Blues")}
    out = {}
    for method in dict.fromkeys(c["method"] for c in cfgs):
        group = [c for c in cfgs if c["method"] == method]
        cmap = maps.get(method, plt.get_cmap("Greens"))
        for i, c in enumerate(group):
            out[c["name"]] = cmap(0.45 + 0.45 * (i / max(1, len(group) - 1)) if len(group) > 1 else 0.7)
    return out


def _save(plt, fig, path: Path, **savefig_kw) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, **savefig_kw)
    plt.close(fig)
    return path


def _subtitle(result: dict) -> str:
    m = result["meta"]
    mode = "greedy" if m.get("greedy", True) else f"T={m.get('temperature')}"
    return f"{m.get('dataset')}, max_tokens={m.get('max_tokens')}, {mode}, {m.get('threads')} threads"


def plot_speedup_per_category(result: dict, path: Path) -> Path:
    plt = _plt()
    cfgs = _spec_configs(result)
    groups = list(result["categories"]) + ["overall"]
    data = {**result["per_category"], "overall": result["overall"]}
    fig, ax = plt.subplots(figsize=(max(6.0, min(16.0, 3 + 0.22 * len(groups) * max(1, len(cfgs)))), 4.5))
    width = 0.8 / max(1, len(cfgs))
    colors = _config_colors(plt, cfgs)
    for j, c in enumerate(cfgs):
        xs = [i + (j - (len(cfgs) - 1) / 2) * width for i in range(len(groups))]
        ys = [data[g][c["name"]]["speedup"] or 0.0 for g in groups]
        ax.bar(xs, ys, width=width, label=c["name"], color=colors[c["name"]], edgecolor="white", linewidth=0.5)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="baseline (1.0x)")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30, ha="right")
    ax.set_ylabel("decode speedup vs baseline (x)")
    ax.set_title("Speedup per category\n" + _subtitle(result), fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.grid(axis="y", alpha=0.3)
    return _save(plt, fig, path, bbox_inches="tight")


def plot_acceptance_per_position(result: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    cfgs = _spec_configs(result)
    colors = _config_colors(plt, cfgs)
    for c in cfgs:
        rates = result["overall"][c["name"]]["per_position_acceptance"]
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=c["name"], color=colors[c["name"]])
    kmax = max((len(result["overall"][c["name"]]["per_position_acceptance"]) for c in cfgs), default=0)
    if kmax:
        ax.set_xticks(range(1, kmax + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (accepted at position / drafts)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance per draft position\n" + _subtitle(result), fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def plot_tokens_per_s_vs_k(result: dict, path: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    overall = result["overall"]
    by_method: dict[str, list[tuple[int, float]]] = {}
    for c in _spec_configs(result):
        v = overall[c["name"]]["decode_tokens_per_s"]
        if v is not None:
            p = c.get("draft_p_min") or 0
            by_method.setdefault((c["method"], p), []).append((c["k"], v))
    for (method, p), pts in by_method.items():
        pts.sort()
        ax.plot([k for k, _ in pts], [v for _, v in pts], marker="o", label=method + (f" p={p:g}" if p else ""),
                color=_COLORS.get(method), linestyle="--" if p else "-")
    base = overall.get("baseline", {}).get("decode_tokens_per_s")
    if base:
        ax.axhline(base, color="black", linestyle="--", linewidth=1, label="baseline (no speculation)")
    ks = sorted({c["k"] for c in _spec_configs(result)})
    if ks:
        ax.set_xticks(ks)
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Decode tokens/s vs k\n" + _subtitle(result), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(plt, fig, path)


def write_plots(result: dict, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [plot_speedup_per_category(result, out / "speedup_per_category.png"),
            plot_acceptance_per_position(result, out / "acceptance_per_position.png"),
            plot_tokens_per_s_vs_k(result, out / "tokens_per_s_vs_k.png")]


def write_serve_plot(result: dict, path: Path) -> Path:
    """A 2x2 PNG: output tokens/s per run, TTFT and ITL CDFs per run, and TTFT per turn (multi-turn) or the
    E2E latency CDF."""
    plt = _plt()
    runs = result["runs"]
    labels = [f"C={r['max_concurrency'] or 'inf'}" + ("" if r["request_rate"] == "inf" else
                                                      f", {r['request_rate']:g} req/s") for r in runs]
    colors = plt.get_cmap("viridis")([0.15 + 0.7 * i / max(1, len(runs) - 1) for i in range(len(runs))])
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    ys = [r["summary"]["output_throughput"] or 0.0 for r in runs]
    bars = ax.bar(range(len(runs)), ys, color=colors, width=0.6)
    for b, y in zip(bars, ys):
        ax.annotate(f"{y:.1f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=9)
    ax.set_xlim(-0.8, len(runs) - 0.2)
    ax.margins(y=0.12)
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput")

    def cdf(ax, key: str, title: str, per_request: Callable[[dict], list[float]]) -> None:
        for run, label, color in zip(runs, labels, colors):
            xs = np.sort(np.asarray([x for rec in run["requests"] if rec["success"] for x in per_request(rec)]))
            if xs.size:
                ax.plot(xs * 1000.0, np.arange(1, xs.size + 1) / xs.size, label=label, color=color,
                        drawstyle="steps-post")
        ax.set_xlabel(f"{key} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)

    cdf(axes[0][1], "TTFT", "Time to first token (CDF)", lambda r: [r["ttft"]] if r["ttft"] is not None else [])
    cdf(axes[1][0], "ITL", "Inter-token latency (CDF, per chunk)", lambda r: r["itl"])
    ax = axes[1][1]
    if any(r["summary"]["multi_turn"] for r in runs):
        for run, label, color in zip(runs, labels, colors):
            mt = run["summary"]["multi_turn"]
            if mt:
                ts = mt["ttft_by_turn"]
                ax.plot([t["turn"] for t in ts], [t["median"] for t in ts], marker="o", label=label, color=color)
        ax.set_xlabel("turn")
        ax.set_ylabel("median TTFT (ms)")
        ax.set_title("TTFT per turn (history grows)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    else:
        cdf(ax, "E2E latency", "End-to-end latency (CDF)",
            lambda r: [r["latency"]] if r["latency"] is not None else [])
    m = result["meta"]
    fig.suptitle(f"{m.get('label') or m['base_url']}: {m['dataset']}, max_tokens={m['max_tokens']}, "
                 f"T={m['temperature']}", fontsize=11)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(plt, fig, path)
