"""Prometheus metrics of the server, under vLLM's own names (``vllm:num_requests_running``,
``vllm:time_to_first_token_seconds``, ``vllm:spec_decode_*``, ``vllm:prefix_cache_queries`` / ``_hits`` in
tokens, ...), so dashboards built for vLLM work unchanged, and the same values with a ``specdecode:`` prefix.
``specdecode:request_errors`` (HTTP errors by status) and ``specdecode:huge_pages_pending_bytes`` have no vLLM
counterpart.

Recorded on the engine thread after every step (prometheus-client is thread-safe), from the step's
outputs and the engine's cumulative spec-decode counters; the HTTP layer adds rejected requests.
"""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)

from specdecode.models import huge_pages
from specdecode.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class _Twin:
    """One metric under vLLM's name and ours (``vllm:x`` and ``specdecode:x``), updated together."""

    def __init__(self, kind, name: str, doc: str, labels: list[str], registry: CollectorRegistry, **kw):
        self.metrics = [kind(n, doc, labels, registry=registry, **kw) for n in (f"vllm:{name}", f"specdecode:{name}")]

    def labels(self, *values: str) -> "_TwinChild":
        return _TwinChild([m.labels(*values) for m in self.metrics])


class _TwinChild:
    def __init__(self, children: list):
        self.children = children

    def inc(self, amount: float = 1.0) -> None:
        for c in self.children:
            c.inc(amount)

    def set(self, value: float) -> None:
        for c in self.children:
            c.set(value)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class ServerMetrics:
    def __init__(self, model_name: str):
        disable_created_metrics()  # no *_created series: they double the output and nobody graphs them
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self.model_name = model_name
        self.running = _Twin(Gauge, "num_requests_running", "Sequences in the running batch.", m, r)
        self.waiting = _Twin(Gauge, "num_requests_waiting", "Sequences waiting for a cache slot.", m, r)
        self.success = _Twin(Counter, "request_success", "Requests the engine finished, by finish reason (stop, "
                             "length, abort = client went away, error = engine failure).", m + ["finished_reason"], r)
        self.errors = Counter("specdecode:request_errors", "Requests answered with an HTTP error, by status.",
                              m + ["status"], registry=r)
        self.prompt_tokens = _Twin(Counter, "prompt_tokens", "Prefilled prompt tokens (once per request).", m, r)
        self.generation_tokens = _Twin(Counter, "generation_tokens", "Generated tokens (all samples).", m, r)
        self.ttft = _Twin(Histogram, "time_to_first_token_seconds", "Arrival to first token.", m, r,
                          buckets=_LATENCY_BUCKETS)
        self.itl = _Twin(Histogram, "inter_token_latency_seconds", "Time between successive outputs of a request "
                         "(one engine step; with speculation a step may emit several tokens).", m, r,
                         buckets=_LATENCY_BUCKETS)
        self.e2e = _Twin(Histogram, "e2e_request_latency_seconds", "Arrival to finish.", m, r, buckets=_E2E_BUCKETS)
        self.spec_drafts = _Twin(Counter, "spec_decode_num_drafts",
                                 "Verification passes that carried at least one drafted token.", m, r)
        self.spec_draft_tokens = _Twin(Counter, "spec_decode_num_draft_tokens", "Drafted tokens.", m, r)
        self.spec_accepted = _Twin(Counter, "spec_decode_num_accepted_tokens", "Accepted drafted tokens.", m, r)
        self.spec_accepted_pos = _Twin(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                       "Accepted drafted tokens by draft position (0 = first).", m + ["position"], r)
        self.prefix_queries = _Twin(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                    m, r)
        self.prefix_hits = _Twin(Counter, "prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache.",
                                 m, r)
        self.preemptions = _Twin(Counter, "num_preemptions",
                                 "Requests preempted (blocks released, prefilled again) for lack of KV cache.", m, r)
        self.kv_usage = _Twin(Gauge, "kv_cache_usage_perc",
                              "Fraction of the KV cache's blocks in use by running requests (0..1).", m, r)
        # No vLLM counterpart: weights still to move onto huge pages (models/huge_pages.py). Until it reads 0 the
        # server runs with a background copy beside it, so a side-by-side benchmark waits for it.
        self.huge_pages_pending = Gauge("specdecode:huge_pages_pending_bytes", "Bytes of weights still to move "
                                        "onto huge pages in the background (0: done).", registry=r)
        self.huge_pages_pending.set_function(huge_pages.pending_bytes)
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)  # every series exists at 0 before anything happened
        for c in (self.prompt_tokens, self.generation_tokens, self.spec_drafts, self.spec_draft_tokens,
                  self.spec_accepted, self.prefix_queries, self.prefix_hits, self.preemptions):
            c.labels(model_name)
        # request id -> (tokens seen so far, time of the last output); engine-thread only
        self._seen: dict[str, tuple[int, float]] = {}
        self._spec = (0, 0, 0, [])
        self._kv = (0, 0, 0)  # prefix queries, hits, preemptions recorded so far

    # ---- engine thread ----
    def on_step(self, outputs: list[RequestOutput], engine, now: float) -> None:
        name = self.model_name
        gen = 0
        for out in outputs:
            total = sum(len(c.token_ids) for c in out.outputs)
            prev = self._seen.get(out.request_id)
            mt = out.metrics
            if prev is None:
                self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
                if mt is not None and mt.first_token_time is not None and total:
                    self.ttft.labels(name).observe(max(0.0, mt.first_token_time - mt.arrival_time))
                prev = (0, now)
            elif total > prev[0]:
                self.itl.labels(name).observe(max(0.0, now - prev[1]))
            gen += total - prev[0]
            if out.finished:
                self._seen.pop(out.request_id, None)
                reasons = [c.finish_reason for c in out.outputs]
                reason = "abort" if "abort" in reasons else (reasons[0] or "stop")
                self.success.labels(name, reason).inc()
                if mt is not None:
                    end = mt.finished_time or now
                    self.e2e.labels(name).observe(max(0.0, end - mt.arrival_time))
            else:
                self._seen[out.request_id] = (total, now if total > prev[0] else prev[1])
        if gen:
            self.generation_tokens.labels(name).inc(gen)
        self._record_spec(engine.spec_stats)
        sched = engine.scheduler
        self.running.labels(name).set(len(sched.running))
        self.waiting.labels(name).set(len(sched.waiting))
        self._record_kv(engine.pool, sched.num_preemptions)

    def _record_kv(self, pool, preemptions: int) -> None:
        name = self.model_name
        now = (pool.queries, pool.hits, preemptions)
        for counter, new, old in zip((self.prefix_queries, self.prefix_hits, self.preemptions), now, self._kv):
            if new > old:
                counter.labels(name).inc(new - old)
        self._kv = now
        self.kv_usage.labels(name).set(pool.num_used_blocks / pool.num_blocks)

    def _record_spec(self, s) -> None:
        name = self.model_name
        d0, t0, a0, p0 = self._spec
        if s.num_drafts > d0:
            self.spec_drafts.labels(name).inc(s.num_drafts - d0)
        if s.num_draft_tokens > t0:
            self.spec_draft_tokens.labels(name).inc(s.num_draft_tokens - t0)
        if s.num_accepted_tokens > a0:
            self.spec_accepted.labels(name).inc(s.num_accepted_tokens - a0)
        for i, n in enumerate(s.accepted_per_pos):
            before = p0[i] if i < len(p0) else 0
            if n > before or i >= len(p0):
                self.spec_accepted_pos.labels(name, str(i)).inc(n - before)
        self._spec = (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_pos))

    def on_engine_error(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._seen.pop(rid, None)
            self.success.labels(self.model_name, "error").inc()
        self.running.labels(self.model_name).set(0)
        self.waiting.labels(self.model_name).set(0)

    # ---- HTTP side ----
    def on_http_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
