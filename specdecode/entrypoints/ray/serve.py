"""Replicas of the engine behind one OpenAI endpoint on Ray Serve, with prefix-aware routing.

    from ray import serve
    from specdecode.entrypoints.ray.serve import build_app
    serve.run(build_app({"model": "model_dir", "speculative_config": {"method": "ngram",
                                                                      "num_speculative_tokens": 4}},
                        num_replicas=2, ray_actor_options={"num_cpus": 1}))

or ``specdecode serve MODEL --ray --num-replicas 2``, or ``serve run specdecode.entrypoints.ray.serve:app_builder
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

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

# Without the extra this raises "No module named 'ray'"; `specdecode serve --ray` turns that into the install hint.
import ray
from ray import serve

from specdecode.entrypoints.ray.deployments import (REPLICA_HEADER, EngineReplica, MetricsHub, OpenAIIngress,
                                                    threads_for)
from specdecode.entrypoints.ray.router import ForwardedRequest, PrefixAffinityRouter, routing_text

__all__ = ["build_app", "app_builder", "serve_from_args", "PrefixAffinityRouter", "ForwardedRequest",
           "REPLICA_HEADER", "ROUTERS", "routing_text"]

ROUTERS = {"prefix": "specdecode.entrypoints.ray.router.PrefixAffinityRouter",
           "pow2": "ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter"}


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
        kw["num_threads"] = threads_for(ray_actor_options["num_cpus"])
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
    """For ``serve run specdecode.entrypoints.ray.serve:app_builder model=DIR num_replicas=2 num_cpus=1
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
