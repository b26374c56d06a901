"""The ASGI gate in front of every route: API key, concurrent requests, body size and deadline, content type."""
from __future__ import annotations

import asyncio
import hmac
from typing import Callable

from fastapi.responses import JSONResponse

from specdecode.entrypoints.openai.errors import RETRY_AFTER_BUSY, APIError, error_body

_DRAIN_FACTOR, _DRAIN_BYTES = 4, 64 * 1024 * 1024  # how much of an oversized body is read only to be dropped
_JSON_LIKE = (b"", b"application/x-www-form-urlencoded", b"text/plain")
API_PATHS = ("/v1", "/tokenize", "/detokenize")  # JSON bodies, behind the API key
_UNCOUNTED = ("/health", "/metrics")  # probes: answered whatever the load


class Gate:
    """Plain ASGI middleware in front of every route; checks run before any body is parsed.

    - API key: /v1/* and the OpenAPI schema need ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key:
      <key>``) when a key is set (compared in constant time); /metrics too with ``metrics_require_key``. /health
      stays open for load balancers.
    - Body size: over ``max_body_bytes`` is a 413, decided from Content-Length or while reading, so a huge
      body is never held or parsed.
    - Slow clients: a body that has not arrived whole ``body_timeout`` seconds after the head is a 408 (a
      deadline for the whole body, not for each read: a client trickling a byte at a time is cut off too).
    - Concurrent requests: beyond ``max_requests`` in progress, a 503 in OpenAI's shape with Retry-After;
      /health and /metrics are not counted and never refused, so a probe sees the server is up, only busy.
    - A POST without a JSON content type (curl -d sends form encoding) is read as JSON, as vLLM does."""

    def __init__(self, app, api_key: str | None, on_reject: Callable[[int], None], max_body_bytes: int,
                 body_timeout: float, metrics_require_key: bool, max_requests: int | None = None):
        self.app = app
        self.max_requests = max_requests
        self.in_flight = 0
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.key = api_key.encode() if api_key else None
        self.on_reject = on_reject
        self.max_body = max_body_bytes
        self.body_timeout = body_timeout
        self.protected = API_PATHS + ("/openapi.json",) + (("/metrics",) if metrics_require_key else ())

    async def _reject(self, send, err: APIError, path: str) -> None:
        self.on_reject(err.status)
        resp = JSONResponse(error_body(err, path), status_code=err.status,
                            headers={"Connection": "close", **(err.headers or {})})
        await resp({"type": "http"}, None, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path in _UNCOUNTED:
            return await self._gate(scope, receive, send, path)
        if self.max_requests is not None and self.in_flight >= self.max_requests:
            return await self._reject(send, APIError(
                503, f"The server has {self.max_requests} requests in progress, its limit; retry shortly.",
                code="server_busy", headers={"Retry-After": RETRY_AFTER_BUSY}), path)
        self.in_flight += 1
        try:
            return await self._gate(scope, receive, send, path)
        finally:
            self.in_flight -= 1

    async def _gate(self, scope, receive, send, path: str):
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and path.startswith(self.protected) and scope.get("method") != "OPTIONS":
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            if not (bearer | hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                return await self._reject(send, APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                    code="invalid_api_key"), path)
        if scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        too_big = APIError(413, f"The request body is larger than the server's limit of {self.max_body} bytes.",
                           code="request_too_large")
        try:
            declared = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            declared = 0
        if declared > self.max_body and headers.get(b"expect", b"").lower() == b"100-continue":
            return await self._reject(send, too_big, path)  # the client waits for our word before sending the body
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return await self._reject(send, APIError(
                    408, f"The request body did not arrive whole within {self.body_timeout:g} s.",
                    code="request_timeout"), path)
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_body:
                chunks.append(chunk)
            elif chunks:
                chunks = []  # over the limit: what follows is read only to be dropped
            if not message.get("more_body", False) or size > _DRAIN_FACTOR * self.max_body + _DRAIN_BYTES:
                break
        if size > self.max_body:
            # The rest was drained (cheaply, up to a bound) so the client, still sending, reads a 413 instead of
            # a reset connection.
            return await self._reject(send, too_big, path)
        body = b"".join(chunks)
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices

        ctype = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if path.startswith(API_PATHS):
            if ctype in _JSON_LIKE:
                scope = dict(scope, headers=[(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
                             + [(b"content-type", b"application/json")])
            elif ctype != b"application/json" and not ctype.endswith(b"+json"):
                return await self._reject(send, APIError(
                    415, f"The request body is sent as {ctype.decode('latin-1')!r}; send it as application/json.",
                    code="unsupported_media_type"), path)
        await self.app(scope, replay, send)
