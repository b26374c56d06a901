"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/responses, /v1/models, vLLM's
/tokenize and /detokenize, /health, /metrics; and Anthropic's /v1/messages.

One AsyncLLMEngine (one engine thread doing continuous batching) serves every request. Run it with
``specdecode serve [MODEL] ...`` or its older vLLM spelling ``python -m specdecode.entrypoints.openai.api_server
--model PATH ...`` (the same command, flags and errors).

This module makes the app (error handlers, the gate in middleware.py, the routes) and runs it under uvicorn.
Each API's routes live in their own module with a ``register(app, **serving_args)``: a new API is one module
and one entry in :data:`ROUTES`.
"""
from __future__ import annotations

if __name__ == "__main__":
    # ``python -m`` runs this file as __main__: parse the command line before the imports below (torch, the
    # web stack), so that --help and a bad flag answer at once. The server itself imports this module again
    # under its own name.
    import sys

    from specdecode.entrypoints.cli import main
    sys.exit(main(["serve", *sys.argv[1:]]))

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.engine.async_engine import AsyncLLMEngine
from specdecode.engine.llm_engine import LLMEngine
from specdecode.entrypoints.anthropic import serving_messages
from specdecode.entrypoints.openai import (serving_chat, serving_completion, serving_models, serving_responses,
                                           serving_tokenization)
from specdecode.entrypoints.openai.cli_args import (DEFAULT_BODY_TIMEOUT, DEFAULT_LIMIT_CONCURRENCY,
                                                    DEFAULT_MAX_BODY_BYTES, add_server_args, engine_kwargs_from_args,
                                                    is_out_of_memory, out_of_memory_message)
from specdecode.entrypoints.openai.connections import (DEFAULT_HEAD_TIMEOUT, DEFAULT_KEEP_ALIVE,
                                                       DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_HEAD_BYTES,
                                                       ConnectionLimits, guarded_protocol, raise_open_files_limit)
from specdecode.entrypoints.openai.errors import APIError, error_body, from_exception, validation_error
from specdecode.entrypoints.openai.json_body import JsonRoute
from specdecode.entrypoints.openai.metrics import ServerMetrics
from specdecode.entrypoints.openai.middleware import Gate
from specdecode.entrypoints.openai.openapi import build_openapi, facts_of
from specdecode.entrypoints.openai.serving_engine import OpenAIServing
from specdecode.structured.tools import resolve_tool_parser

__all__ = ["add_server_args", "run_server", "build_app", "engine_kwargs_from_args", "ROUTES"]

# Each API's ``register(app, **serving_args)``, in the order their routes appear (and are documented).
ROUTES: tuple[Callable[..., None], ...] = (serving_models.register, serving_tokenization.register,
                                           serving_completion.register, serving_chat.register,
                                           serving_responses.register, serving_messages.register)


# ====================================================================== app
def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> Callable[[APIError], JSONResponse]:
    """Every error in OpenAI's shape, counted in the metrics; returns the function that makes such a response."""
    def error_response(err: APIError, path: str = "") -> JSONResponse:
        metrics.on_http_error(err.status)
        return JSONResponse(error_body(err, path), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        # FastAPI raises a 400 itself only for a body it could not decode (bad UTF-8, a number too long to read)
        code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        # the exception's headers carry what the client needs, e.g. a 405's Allow
        return error_response(APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers),
                              request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(from_exception(exc), request.url.path)

    return error_response


def build_app(engine_kwargs: dict | None = None, served_model_name: str | list[str] | None = None,
              api_key: str | None = None, *, engine: AsyncLLMEngine | LLMEngine | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout: float = DEFAULT_BODY_TIMEOUT,
              metrics_require_key: bool = False, tool_call_parser: str = "auto", webui: bool = True,
              max_requests: int | None = DEFAULT_LIMIT_CONCURRENCY) -> FastAPI:
    """The FastAPI app. Loads the engine now (ValueError for bad settings) unless one is passed in.
    ``webui``: serve the chat page at ``/`` (specdecode/entrypoints/webui).

    ``metrics_require_key``: /metrics is open by default, as in vLLM (scrapers rarely send keys); set it to
    put /metrics behind the API key too. ``max_requests``: requests in progress beyond it get a 503."""
    resolve_tool_parser(tool_call_parser)  # an unknown name fails before the models load
    if engine is None:
        engine = AsyncLLMEngine.from_kwargs(**(engine_kwargs or {}))
    elif isinstance(engine, LLMEngine):
        engine = AsyncLLMEngine(engine)
    kw = engine_kwargs or {}
    model_path = kw.get("model") or str(getattr(engine.engine, "model_path", "") or "") or None
    if isinstance(served_model_name, str):
        names = [served_model_name]
    elif served_model_name:
        names = list(served_model_name)
    else:
        default_path = getattr(engine.engine, "model_path", None)
        names = [kw.get("model") or (os.path.basename(str(default_path)) if default_path else "specdecode")]
    metrics = ServerMetrics(names[0])
    engine.step_callback = metrics.on_step
    engine.error_callback = metrics.on_engine_error
    serving_args: dict[str, Any] = dict(engine=engine, served_model_names=names, metrics=metrics,
                                        model_path=model_path, tool_call_parser=tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="specdecode OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.router.route_class = JsonRoute  # every route's body through the one JSON reader
    app.state.server = OpenAIServing(**serving_args)
    app.state.engine = engine
    app.state.webui = webui
    app.add_middleware(Gate, api_key=api_key, on_reject=metrics.on_http_error, max_body_bytes=max_body_bytes,
                       body_timeout=body_timeout, metrics_require_key=metrics_require_key, max_requests=max_requests)
    app.openapi = functools.partial(build_openapi, app, facts_of(engine))
    error_response = _add_error_handlers(app, metrics)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(APIError(503, "The engine loop is not running.", code="engine_unavailable"))
        return Response(status_code=200)

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)  # load balancers probe with it

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    for register in ROUTES:
        register(app, **serving_args)
    if webui:
        from specdecode.entrypoints.webui import routes as webui_routes
        webui_routes.register(app)
    return app


# ====================================================================== command line
def _fail(msg: str) -> None:
    print(f"specdecode serve: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        _fail(f"cannot listen on {host}:{port}: {e.strerror or e}.")
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, but streams still running when the graceful-shutdown period is about to run out get
    an error event and ``[DONE]`` (a non-streaming request, a 503) instead of being cut mid-response."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, grace: float):
        super().__init__(config)
        self.engine = engine
        self.grace = grace

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        last_word = loop.call_later(max(0.0, self.grace - 1.0), self.engine.fail_in_flight,
                                    "The server is shutting down; the request was not completed.")
        try:
            await super().shutdown(sockets)
        finally:
            last_word.cancel()


def uvicorn_config(app: FastAPI, args: argparse.Namespace, grace: float) -> uvicorn.Config:
    """uvicorn's settings for the server, with the connection limits of connections.py."""
    def flag(name: str, default: Any) -> Any:
        value = getattr(args, f"server.{name}", None)
        return default if value is None else value

    limits = ConnectionLimits(head_timeout=flag("request_head_timeout", DEFAULT_HEAD_TIMEOUT),
                              max_connections=flag("max_connections", DEFAULT_MAX_CONNECTIONS),
                              max_head_bytes=flag("max_request_head_bytes", DEFAULT_MAX_HEAD_BYTES))
    raise_open_files_limit(limits.max_connections + 256)  # and some for the model files, logs, the engine
    # asyncio's own event loop and no WebSocket protocol: uvloop and the websockets package would be imported
    # at every start, after the engine is ready, for streams whose pace the engine sets, not the loop. h11
    # parses heads, with room beyond our own limit so that ours (a 431) is the one that answers.
    return uvicorn.Config(app, log_level=getattr(args, "uvicorn_log_level", None) or "warning",
                          loop="asyncio", ws="none", http=guarded_protocol(limits),
                          h11_max_incomplete_event_size=2 * limits.max_head_bytes + 64 * 1024,
                          timeout_graceful_shutdown=grace, lifespan="on",
                          timeout_keep_alive=flag("timeout_keep_alive", DEFAULT_KEEP_ALIVE))


def run_server(args: argparse.Namespace, model: str | None, engine: AsyncLLMEngine | None = None) -> None:
    """Loads the engine (or waits for ``engine``, started from the same arguments), then serves until
    SIGINT/SIGTERM. Bad settings: one line on stderr, exit code 2."""
    host, port = getattr(args, "host", None) or "127.0.0.1", getattr(args, "port", None)
    port = 8000 if port is None else port
    if not (0 <= port <= 65535):
        _fail(f"--port must be in 0..65535, got {port}.")
    api_key = getattr(args, "api_key", None) or os.environ.get("SPECDECODE_API_KEY") or None
    kw: dict[str, Any] = {}
    try:
        kw = engine_kwargs_from_args(args, model)
        if engine is not None:
            engine.wait_built()
        app = build_app(kw, getattr(args, "served_model_name", None), api_key, engine=engine,
                        max_body_bytes=getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_BODY_BYTES,
                        body_timeout=getattr(args, "request_body_timeout", None) or DEFAULT_BODY_TIMEOUT,
                        metrics_require_key=bool(getattr(args, "metrics_require_key", False)),
                        tool_call_parser=getattr(args, "server.tool_call_parser", None) or "auto",
                        webui=getattr(args, "server.webui", None) is not False,
                        max_requests=getattr(args, "limit_concurrency", None) or DEFAULT_LIMIT_CONCURRENCY)
    except (ValueError, OSError, RuntimeError) as e:
        if is_out_of_memory(e):  # the KV cache, allocated at load, sized by the flags
            _fail(out_of_memory_message(kw))
        if isinstance(e, RuntimeError):
            raise
        _fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    except KeyboardInterrupt:
        sys.exit(130)
    sock = _bind(host, port)
    grace = getattr(args, "timeout_graceful_shutdown", None)
    grace = 30.0 if grace is None else grace
    config = uvicorn_config(app, args, grace)
    server = _Server(config, app.state.engine, grace)
    host, port = sock.getsockname()[:2]
    print(f"specdecode: serving {app.state.server.names[0]} on http://{host}:{port} "
          f"(OpenAI API under /v1{'; chat page at /' if app.state.webui else ''}; Ctrl+C to stop)",
          file=sys.stderr, flush=True)
    if threading.current_thread() is threading.main_thread():
        # uvicorn handles SIGINT/SIGTERM itself (stop accepting, let in-flight requests finish, lifespan
        # shutdown stops the engine) and then re-raises the signal to the previous handler: make that a
        # return from server.run instead of a death by signal.
        signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        app.state.engine.shutdown()
        with contextlib.suppress(OSError):
            sock.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m specdecode.entrypoints.openai.api_server [MODEL] [flags]``, vLLM's older spelling: the same
    command as ``specdecode serve``, with its flags, start-up and one-line errors."""
    from specdecode.entrypoints.cli import main as cli_main
    sys.exit(cli_main(["serve", *(sys.argv[1:] if argv is None else argv)]))
