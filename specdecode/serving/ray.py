"""Replicas of the engine behind one OpenAI endpoint on Ray Serve, with prefix-aware routing.

    from ray import serve
    from specdecode.serving.ray import build_app
    serve.run(build_app({"model": "model_dir", "speculative_config": {"method": "ngram",
                                                                      "num_speculative_tokens": 4}},
                        num_replicas=2, ray_actor_options={"num_cpus": 1}))

or ``specdecode serve MODEL --ray --num-replicas 2``, or ``serve run specdecode.serving.ray:app_builder
model=model_dir num_replicas=2``.

The application has three deployments, laid out as Ray Serve's own LLM apps are (an OpenAI ingress in front of
engine replicas):

* ``OpenAIIngress`` (no CPU reserved) receives every HTTP request from Ray's proxy, reads the body, takes the
  prompt text out of it for routing, and forwards method, path, headers and body to one engine replica through
  a deployment handle; the replica's response (status, headers, body chunks) streams back unchanged.
* ``EngineReplica`` (``num_replicas`` of them, ``ray_actor_options["num_cpus"]`` each) owns one engine and
  runs the single-process server's FastAPI app (``specdecode.entrypoints.openai.api_server.build_app``) on
  each forwarded request, so routes, validation, streaming and error bodies are exactly that server's. Its
  engine uses as many CPU threads as the replica reserves CPUs.
* ``MetricsHub`` (no CPU reserved) receives each replica's Prometheus metrics every second and serves their sum
  on ``/metrics``; a replica that died keeps its last counters in the sums, so totals never go backwards.

Why a separate ingress: Ray's proxy hands a replica the ASGI scope only (the body arrives later), so a request
router on the ingress itself never sees the prompt. Routing on the hop from the ingress to the engine replicas
gives :class:`PrefixAffinityRouter` the prompt, the same split Ray's LLM apps use.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import signal
import socket
import sys
import threading
import time
from typing import Any, AsyncIterator, Iterable

# Without the extra this raises "No module named 'ray'"; `specdecode serve --ray` turns that into the install hint.
import ray
from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("specdecode.serving")

__all__ = ["build_app", "app_builder", "serve_from_args", "PrefixAffinityRouter", "ForwardedRequest",
           "REPLICA_HEADER", "ROUTERS"]

REPLICA_HEADER = "x-specdecode-replica"
ROUTERS = {"prefix": "specdecode.serving.ray.PrefixAffinityRouter",
           "pow2": "ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter"}
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_METRICS_PUSH_S = 1.0
_STALE_AFTER_S = 5.0  # a replica silent this long no longer contributes gauges (its counters stay)


# ====================================================================== the forwarded request
@dataclasses.dataclass
class ForwardedRequest:
    """One HTTP request as the ingress forwards it to an engine replica.

    ``prompt`` is the routing key only (the replica parses the body itself): the prompt text, or the chat
    messages flattened in order, so a later turn of a conversation starts with the text of the earlier ones.
    Ray's own ``PrefixCacheAffinityRouter`` reads the same attribute."""
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str | None = None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) and isinstance(p.get("text"), str) else ""
                       for p in content)
    return ""


def routing_text(path: str, body: bytes) -> str | None:
    """The prompt text a generation request carries (None for other requests and for bodies that do not parse:
    those go to the least loaded replica, which answers them as the single-process server would)."""
    return _inspect(path, body)[0]


def _inspect(path: str, body: bytes) -> tuple[str | None, bool]:
    """(routing text, whether the response streams)."""
    if path not in _GENERATION_PATHS or not body:
        return None, False
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None, False
    if not isinstance(req, dict):
        return None, False
    return _prompt_text(path, req), req.get("stream") is True


def _prompt_text(path: str, req: dict) -> str | None:
    if path == "/v1/completions":
        prompt = req.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]  # a batch: the first prompt decides
        if isinstance(prompt, str):
            return prompt or None
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return " ".join(map(str, prompt)) or None
        return None
    messages = req.get("messages")
    if not isinstance(messages, list):
        return None
    parts = []
    for m in messages:
        if isinstance(m, dict):
            parts.append(f"<|{m.get('role')}|>{_text_of(m.get('content'))}\n")
    return "".join(parts) or None


# ====================================================================== prefix-aware request router
class PrefixAffinityRouter(RequestRouter):
    """Sends a request to a replica that served the longest prefix of its prompt, unless that replica is busier
    than the least loaded one by more than ``imbalanced_threshold`` requests; otherwise power of two choices.

    Prompts are cut into blocks of ``block_chars`` characters; a chained hash of the blocks names each prefix,
    and a bounded LRU table maps a prefix to the replicas that served it. Lookups and inserts are in-process
    (no actor round trip on the routing path). Each ingress replica routes with its own table; with one ingress
    (the default) that is the whole picture. The preferred replicas come as the first rank and the others as a
    second, so when the preferred ones are full (``max_ongoing_requests``) Ray goes on to the rest at once."""

    def initialize_state(self, block_chars: int = 64, imbalanced_threshold: int = 4,
                         max_prefixes: int = 200_000) -> None:
        if block_chars < 1 or imbalanced_threshold < 0 or max_prefixes < 1:
            raise ValueError("PrefixAffinityRouter needs block_chars >= 1, imbalanced_threshold >= 0 and "
                             "max_prefixes >= 1.")
        self._block = int(block_chars)
        self._threshold = imbalanced_threshold
        self._max_prefixes = int(max_prefixes)
        self._owners: collections.OrderedDict[int, dict[ReplicaID, None]] = collections.OrderedDict()
        self.affinity_hits = 0  # requests sent to a prefix owner (for tests and debugging)

    def _hashes(self, text: str) -> Iterable[int]:
        h, b = 0, self._block
        for end in range(b, len(text) + 1, b):
            h = hash((h, text[end - b:end]))
            yield h

    @staticmethod
    def _key(pending_request: PendingRequest | None) -> str | None:
        if pending_request is None or not pending_request.args:
            return None
        prompt = getattr(pending_request.args[0], "prompt", None)
        return prompt if isinstance(prompt, str) and prompt else None

    def _owners_of(self, text: str, live: dict[ReplicaID, RunningReplica]) -> list[ReplicaID]:
        best: list[ReplicaID] = []
        for h in self._hashes(text):
            owners = self._owners.get(h)
            if owners is None:
                break  # prefixes nest: a longer one cannot be known when this one is not
            found = [rid for rid in owners if rid in live]
            if found:
                best = found
        return best

    def _imbalanced(self, owners: list[ReplicaID], live: dict[ReplicaID, RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        lens = {rid: cache.get(rid) for rid in live}
        known = [v for v in lens.values() if v is not None]
        owner_lens = [lens[rid] for rid in owners if lens[rid] is not None]
        if not known or not owner_lens:
            return False
        return min(owner_lens) - min(known) > self._threshold

    @staticmethod
    def _two_choices(replicas: list[RunningReplica]) -> list[RunningReplica]:
        return random.sample(replicas, min(2, len(replicas)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        text = self._key(pending_request)
        if text is not None:
            live = {r.replica_id: r for r in candidate_replicas}
            owners = self._owners_of(text, live)
            if owners and not self._imbalanced(owners, live):
                self.affinity_hits += 1
                rest = [r for rid, r in live.items() if rid not in owners]
                ranks = [[live[rid] for rid in owners]]
                if rest:
                    ranks.append(self._two_choices(rest))
                return ranks
        return [self._two_choices(candidate_replicas)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        text = self._key(pending_request)
        if text is None:
            return
        table = self._owners
        for h in self._hashes(text):
            owners = table.get(h)
            if owners is None:
                owners = table[h] = {}
            else:
                table.move_to_end(h)
            owners.pop(replica_id, None)
            owners[replica_id] = None  # most recent owner last
        while len(table) > self._max_prefixes:
            table.popitem(last=False)


# ====================================================================== metrics
def _merge_metrics(snapshots: list[tuple[str, float]], now: float) -> bytes:
    """Sums Prometheus texts of several replicas: counters and histograms of every replica ever seen (a dead
    replica's last values stay), gauges of the replicas heard from recently."""
    from prometheus_client.core import Metric
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple, list]] = {}
    for text, seen in snapshots:
        fresh = now - seen <= _STALE_AFTER_S
        for fam in text_string_to_metric_families(text):
            if fam.type == "gauge" and not fresh:
                continue
            if fam.name not in families:
                families[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                sums[fam.name] = {}
            acc = sums[fam.name]
            for s in fam.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key in acc:
                    acc[key][1] += s.value
                else:
                    acc[key] = [s.labels, s.value]  # the first replica's label order is kept
    for name, fam in families.items():
        for (sample, _), (labels, value) in sums[name].items():
            fam.add_sample(sample, labels, value)

    class _Collector:
        def collect(self):
            return list(families.values())

    from prometheus_client import CollectorRegistry
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector())
    return generate_latest(reg)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
class MetricsHub:
    """Latest Prometheus text of each engine replica, summed on request."""

    def __init__(self) -> None:
        self._snapshots: dict[str, tuple[str, float]] = {}
        self._replica_failures = 0

    def push(self, replica: str, text: str) -> None:
        self._snapshots[replica] = (text, time.time())

    def replica_failed(self) -> None:
        self._replica_failures += 1

    def render(self) -> bytes:
        now = time.time()
        merged = _merge_metrics(list(self._snapshots.values()), now)
        live = sum(1 for _, seen in self._snapshots.values() if now - seen <= _STALE_AFTER_S)
        extra = ("# HELP specdecode:ray_replicas_reporting Engine replicas that reported metrics recently.\n"
                 "# TYPE specdecode:ray_replicas_reporting gauge\n"
                 f"specdecode:ray_replicas_reporting {live}\n"
                 "# HELP specdecode:ray_replica_failures_total Requests whose replica died while serving "
                 "them (streams end with an error event).\n"
                 "# TYPE specdecode:ray_replica_failures_total counter\n"
                 f"specdecode:ray_replica_failures_total {self._replica_failures}\n")
        return merged + extra.encode()


# ====================================================================== engine replica
def _threads_for(num_cpus: Any) -> int:
    try:
        return max(1, int(math.floor(float(num_cpus))))
    except (TypeError, ValueError):
        return 1


@serve.deployment
class EngineReplica:
    """One engine and the single-process server's FastAPI app, run on forwarded requests."""

    async def __init__(self, engine_args: dict, served_model_name: str | list[str] | None, api_key: str | None,
                       metrics_hub: Any = None) -> None:
        from specdecode.entrypoints.openai.api_server import build_app as build_openai_app

        ctx = serve.get_replica_context()
        self.replica_id: str = ctx.replica_id.unique_id
        self._header = (REPLICA_HEADER.encode(), self.replica_id.encode())
        # Built on this (the replica's user-code) thread; the engine itself loads on its own engine thread.
        self.app = build_openai_app(dict(engine_args), served_model_name, api_key)
        self.engine = self.app.state.engine
        self.metrics = self.app.state.server.metrics
        self._hub = metrics_hub
        self._push_task = asyncio.get_running_loop().create_task(self._push_metrics()) if metrics_hub else None

    async def _push_metrics(self) -> None:
        while True:
            try:
                # Pushed even when unchanged: a replica that stops pushing is taken for dead (gauges dropped).
                await self._hub.push.remote(self.replica_id, self.metrics.render().decode())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the hub restarting must not stop the replica
                logger.debug("metrics push failed", exc_info=True)
            await asyncio.sleep(_METRICS_PUSH_S)

    def check_health(self) -> None:
        """Ray Serve calls this periodically; a replica whose engine loop died is restarted."""
        if not self.engine.is_running:
            raise RuntimeError("The engine loop of this replica is not running.")

    def __del__(self) -> None:
        if getattr(self, "_push_task", None) is not None:
            self._push_task.cancel()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    async def call(self, req: ForwardedRequest) -> dict:
        """The whole response at once (a plain actor call is cheaper than a streamed one)."""
        out: dict = {"more": False}
        chunks = []
        async for item in self.handle(req):
            out.setdefault("status", item.get("status"))
            out.setdefault("headers", item.get("headers"))
            chunks.append(item["body"])
        out["body"] = b"".join(chunks)
        return out

    async def handle(self, req: ForwardedRequest) -> AsyncIterator[dict]:
        """Runs the request through the app and yields what it sends, coalesced: dicts with ``status`` and
        ``headers`` (first one only), ``body`` (bytes) and ``more`` (False on the last one)."""
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": req.method, "scheme": "http", "path": req.path, "raw_path": req.path.encode(),
                 "root_path": "", "query_string": req.query_string, "headers": req.headers,
                 "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 0)}
        queue: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await gone.wait()  # the ingress stopped listening: tell the app the client went away
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            queue.put_nowait(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except Exception as e:  # noqa: BLE001 - the app's own handlers answer everything they know
                queue.put_nowait(e)
            finally:
                queue.put_nowait(None)

        task = asyncio.get_running_loop().create_task(run())
        try:
            started = False
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                out: dict = {"body": b"", "more": True}
                chunks = []
                for m in items:
                    if m is None or isinstance(m, Exception):
                        if not started:  # the app died before answering
                            raise m if m is not None else RuntimeError("The app sent no response.")
                        out["more"] = False
                        break
                    if m["type"] == "http.response.start":
                        started = True
                        out["status"] = m["status"]
                        out["headers"] = list(m.get("headers") or []) + [self._header]
                    elif m["type"] == "http.response.body":
                        chunks.append(m.get("body", b""))
                        if not m.get("more_body", False):
                            out["more"] = False
                            break
                out["body"] = b"".join(chunks)
                if "status" in out or out["body"] or not out["more"]:
                    yield out
                if not out["more"]:
                    break
        finally:
            gone.set()
            if not task.done():
                task.cancel()  # ends the app's stream, which aborts the engine request


# ====================================================================== ingress
_RETRYABLE = ("ActorDiedError", "ActorUnavailableError", "RayActorError", "ActorUnschedulableError")


def _replica_lost(e: BaseException) -> bool:
    return any(cls.__name__ in _RETRYABLE for cls in type(e).__mro__)


def _error(status: int, message: str, code: str) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
class OpenAIIngress:
    """The HTTP entry point: forwards each request to an engine replica chosen by the request router."""

    def __init__(self, engine: Any, metrics_hub: Any) -> None:
        self._engine = engine
        self._streaming = engine.options(stream=True)
        self._hub = metrics_hub

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        # The app's routes are /v1/...: drop the app's route prefix (serve.run(..., route_prefix="/x")).
        path, root = request.scope.get("path", "/"), request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if path == "/metrics" and request.method == "GET":
            text = await self._hub.render.remote()
            return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
        prompt, stream = _inspect(path, body)
        fwd = ForwardedRequest(method=request.method, path=path, query_string=request.scope.get("query_string", b""),
                               headers=list(request.scope.get("headers") or []), body=body, prompt=prompt)
        gen = None
        first: dict | None = None
        for attempt in range(3):
            try:
                if stream:
                    gen = self._streaming.handle.remote(fwd)
                    first = await gen.__anext__()
                else:
                    first = await self._engine.call.remote(fwd)
                break
            except StopAsyncIteration:
                return JSONResponse(_error(502, "The replica sent no response.", "replica_error"), status_code=502)
            except Exception as e:  # noqa: BLE001
                if type(e).__name__ == "BackPressureError":
                    return JSONResponse(_error(503, "Too many requests are queued; retry later.", "queue_full"),
                                        status_code=503)
                if not _replica_lost(e):
                    logger.exception("forwarding a request failed")
                    return JSONResponse(_error(500, f"Internal server error ({type(e).__name__}).",
                                               "internal_error"), status_code=500)
                # Nothing reached the client yet, so the request can go to another replica.
                logger.warning("replica lost before answering (%s); retrying on another", type(e).__name__)
                self._hub.replica_failed.remote()
                await asyncio.sleep(0.05 * (attempt + 1))
        if first is None:
            return JSONResponse(_error(503, "No engine replica could take the request.", "engine_unavailable"),
                                status_code=503)
        status, headers = first["status"], first["headers"]
        if not first["more"]:
            resp = Response(first["body"], status_code=status)
            resp.raw_headers = headers
            return resp
        event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        hub = self._hub

        async def rest() -> AsyncIterator[bytes]:
            if first["body"]:
                yield first["body"]
            try:
                async for item in gen:
                    if item["body"]:
                        yield item["body"]
            except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band, as the server does
                logger.warning("the replica serving a stream failed: %s", type(e).__name__)
                if _replica_lost(e):
                    hub.replica_failed.remote()
                if not event_stream:
                    raise
                msg = ("The engine replica serving this request died; the response is incomplete."
                       if _replica_lost(e) else f"Internal server error ({type(e).__name__}).")
                err = _error(503 if _replica_lost(e) else 500, msg,
                             "replica_died" if _replica_lost(e) else "internal_error")
                yield f"data: {json.dumps(err)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                gen.cancel()  # a client that went away: the replica aborts the engine request

        resp = StreamingResponse(rest(), status_code=status)
        resp.raw_headers = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"transfer-encoding")]
        return resp


# ====================================================================== builders
_SERVING_KEYS = ("num_replicas", "autoscaling_config", "ray_actor_options", "served_model_name", "api_key",
                 "request_router", "router_kwargs", "max_ongoing_requests", "max_queued_requests")


def _decode(value: Any) -> Any:
    """``serve run`` passes key=value strings: numbers, booleans and JSON objects/lists are decoded."""
    if not isinstance(value, str):
        return value
    s = value.strip()
    if s in ("true", "false", "null") or s[:1] in "{[-0123456789":
        try:
            return json.loads(s)
        except ValueError:
            return value
    return value


def build_app(engine_args: dict, num_replicas: int | str | None = 1, autoscaling_config: dict | None = None,
              ray_actor_options: dict | None = None, *, served_model_name: str | list[str] | None = None,
              api_key: str | None = None, request_router: str | type = "prefix", router_kwargs: dict | None = None,
              max_ongoing_requests: int | None = None,
              max_queued_requests: int | None = None) -> "serve.Application":
    """The Ray Serve application: ``serve.run(build_app(...))``.

    engine_args: the engine's keyword arguments (as for ``LLM(...)``); each replica builds one engine from them.
    num_replicas: engine replicas (ignored when ``autoscaling_config`` is given).
    ray_actor_options: per engine replica; ``num_cpus`` (default 1) is also the engine's thread count unless
        ``engine_args`` sets ``num_threads``.
    request_router: "prefix" (prefix-aware, the default), "pow2" (Ray's power of two choices), or a
        ``RequestRouter`` subclass or import path; router_kwargs go to its ``initialize_state``.
    max_ongoing_requests: requests one replica holds at once (default: the engine's ``max_num_seqs``), so the
        router, not the engine queue, decides where waiting requests go. max_queued_requests: requests waiting
        in the router before new ones get HTTP 503 (default: the engine's ``max_waiting_requests``).

    Raises ValueError for engine options the engine would reject (checked here, before anything deploys)."""
    from specdecode.config import EngineConfig

    kw = {k: _decode(v) for k, v in dict(engine_args or {}).items()}
    opts = {k: kw.pop(k) for k in _SERVING_KEYS if k in kw}  # serve run puts everything in one dict
    num_replicas = opts.get("num_replicas", num_replicas)
    autoscaling_config = opts.get("autoscaling_config", autoscaling_config)
    ray_actor_options = dict(opts.get("ray_actor_options", ray_actor_options) or {})
    served_model_name = opts.get("served_model_name", served_model_name)
    api_key = opts.get("api_key", api_key)
    request_router = opts.get("request_router", request_router)
    router_kwargs = opts.get("router_kwargs", router_kwargs)
    max_ongoing_requests = opts.get("max_ongoing_requests", max_ongoing_requests)
    max_queued_requests = opts.get("max_queued_requests", max_queued_requests)

    num_cpus = kw.pop("num_cpus", None)  # a serve-run convenience: num_cpus=1 means ray_actor_options
    if num_cpus is not None:
        ray_actor_options["num_cpus"] = num_cpus
    ray_actor_options.setdefault("num_cpus", 1)
    if kw.get("num_threads") is None:
        kw["num_threads"] = _threads_for(ray_actor_options["num_cpus"])
    cfg = EngineConfig.from_kwargs(**kw)  # ValueError now, not a replica crash loop later

    if autoscaling_config is None and (not isinstance(num_replicas, int) or num_replicas < 1):
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}.")
    router_cls = ROUTERS.get(request_router, request_router) if isinstance(request_router, str) else request_router
    if isinstance(request_router, str) and request_router not in ROUTERS and "." not in request_router:
        raise ValueError(f"request_router must be one of {sorted(ROUTERS)} or an import path, got {request_router!r}.")
    from ray.serve.config import RequestRouterConfig

    router_cfg = RequestRouterConfig(request_router_class=router_cls, request_router_kwargs=dict(router_kwargs or {}))
    engine_opts: dict[str, Any] = dict(
        ray_actor_options=ray_actor_options, request_router_config=router_cfg,
        max_ongoing_requests=max_ongoing_requests or cfg.max_num_seqs,
        max_queued_requests=max_queued_requests or cfg.max_waiting_requests,
        health_check_period_s=5, graceful_shutdown_timeout_s=5)
    if autoscaling_config is not None:
        engine_opts["autoscaling_config"] = autoscaling_config
        engine_opts["num_replicas"] = "auto" if not isinstance(num_replicas, int) else None
        if engine_opts["num_replicas"] is None:
            del engine_opts["num_replicas"]
    else:
        engine_opts["num_replicas"] = num_replicas
    # Ray logs every request at INFO on each hop; the engine's own metrics already count them.
    quiet = {"logging_config": {"log_level": "WARNING", "enable_access_log": False}}
    hub = MetricsHub.options(**quiet).bind()
    engine = EngineReplica.options(**engine_opts, **quiet).bind(kw, served_model_name, api_key, hub)
    return OpenAIIngress.options(**quiet).bind(engine, hub)


def app_builder(args: dict) -> "serve.Application":
    """For ``serve run specdecode.serving.ray:app_builder model=DIR num_replicas=2 num_cpus=1
    speculative_config='{"method": "ngram", "num_speculative_tokens": 4}'``: every key=value goes to
    :func:`build_app` (serving options by name, the rest to the engine)."""
    return build_app(dict(args))


# ====================================================================== command line
def serve_from_args(args: Any, engine_kwargs: dict) -> int:
    """``specdecode serve --ray --num-replicas N``: starts a local Ray instance (or joins the cluster at
    RAY_ADDRESS / ``args.ray_address``), deploys the app on host:port, and serves until SIGINT/SIGTERM; then removes
    the app (and stops the local instance). Optional args: ``num_cpus_per_replica`` (default: this machine's
    cores shared out locally, 1 on a cluster), ``request_router``. Bad settings print one line
    (``specdecode serve: error: ...``) and return 2."""
    def fail(msg: str) -> int:
        print(f"specdecode serve: error: {msg}", file=sys.stderr)
        return 2

    host = getattr(args, "host", None) or "127.0.0.1"
    port = getattr(args, "port", None)
    port = 8000 if port is None else port
    num_replicas = getattr(args, "num_replicas", None) or 1
    api_key = getattr(args, "api_key", None) or os.environ.get("SPECDECODE_API_KEY") or None
    address = getattr(args, "ray_address", None) or os.environ.get("RAY_ADDRESS") or None
    cpus = getattr(args, "num_cpus_per_replica", None) or engine_kwargs.get("num_threads")
    if cpus is None:  # a local cluster: share this machine's cores; on a cluster, 1 unless told
        cpus = max(1, (os.cpu_count() or 1) // num_replicas) if address is None else 1
    try:
        app = build_app(engine_kwargs, num_replicas, ray_actor_options={"num_cpus": cpus},
                        served_model_name=getattr(args, "served_model_name", None), api_key=api_key,
                        request_router=getattr(args, "request_router", None) or "prefix")
    except ValueError as e:
        return fail(str(e).strip().splitlines()[0])
    if not (0 <= port <= 65535):
        return fail(f"--port must be in 0..65535, got {port}.")
    if address is None:  # Ray's proxy retries a busy port forever: say so now
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((host, port))
        except OSError as e:
            return fail(f"cannot listen on {host}:{port}: {e.strerror or e}.")

    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    started_ray = False
    try:
        if not ray.is_initialized():
            if address is None:  # a local instance of our own
                ray.init(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
            else:
                ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            started_ray = address is None
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(app, name="specdecode", route_prefix="/")
        except Exception as e:  # noqa: BLE001 - a replica that cannot start (bad model path, out of memory)
            return fail(f"the Ray Serve app did not start: {str(e).strip().splitlines()[-1][:300]}")
        print(f"specdecode: serving {num_replicas} replica(s) on http://{host}:{port} through Ray Serve "
              f"(OpenAI API under /v1; Ctrl+C to stop)", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            pass
        return 0
    finally:
        # Our own instance goes away whole; on a shared cluster only this app is removed (Serve, its proxy and
        # other apps stay).
        with contextlib.suppress(Exception):
            if started_ray:
                serve.shutdown()
            else:
                serve.delete("specdecode")
        if started_ray:
            with contextlib.suppress(Exception):
                ray.shutdown()
        for s, h in previous.items():
            signal.signal(s, h)
