"""The Ray Serve app's deployments: the HTTP ingress, the engine replicas (each running the single-process
server's app) and the metrics hub that sums their Prometheus metrics. serve.py binds them into one app."""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any, AsyncIterator

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from specdecode.entrypoints.ray.router import ForwardedRequest, inspect_request

logger = logging.getLogger("specdecode.serving")

REPLICA_HEADER = "x-specdecode-replica"
_METRICS_PUSH_S = 1.0
_STALE_AFTER_S = 5.0  # a replica silent this long no longer contributes gauges (its counters stay)


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
def threads_for(num_cpus: Any) -> int:
    """The engine threads of a replica that reserves ``num_cpus`` CPUs (whole ones, at least 1)."""
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
        prompt, stream = inspect_request(path, body)
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

