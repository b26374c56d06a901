"""One streamed request as a client sees it (TTFT, the gaps between chunks, output tokens, speculative
statistics), and the server's /metrics counters."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

# /metrics counter names, in order of preference (vLLM's names first: our server exports both spellings of the
# same counters, so only one is read).
_METRIC_NAMES = {
    "drafts": ("vllm:spec_decode_num_drafts", "specdecode:spec_decode_num_drafts"),
    "drafted": ("vllm:spec_decode_num_draft_tokens", "specdecode:spec_decode_num_draft_tokens"),
    "accepted": ("vllm:spec_decode_num_accepted_tokens", "specdecode:spec_decode_num_accepted_tokens"),
    "prefix_queries": ("vllm:prefix_cache_queries", "specdecode:prefix_cache_queries"),
    "prefix_hits": ("vllm:prefix_cache_hits", "specdecode:prefix_cache_hits"),
}


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
