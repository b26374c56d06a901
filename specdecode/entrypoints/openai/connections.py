"""Connection-level limits, below the ASGI app: what a client can hold without sending a request.

uvicorn's own settings cover the idle time between requests on a keep-alive connection (``timeout_keep_alive``).
What it has no setting for is added here, in a subclass of its h11 protocol:

- a deadline for the request head: a connection that sends nothing, or a head that never ends, is closed
  (with a 408 when part of a head arrived) instead of holding a slot for as long as the client likes;
- a bound on the head's size: a 431 in OpenAI's error shape (h11 would send a plain-text 400);
- a bound on open connections that never locks out a real request: when the table is full, the connection
  that has been idle the longest is closed to make room, and only when every connection is busy with a request
  does a new one get a 503 in OpenAI's shape with ``Retry-After``.

uvicorn's ``limit_concurrency`` is left off: it counts idle sockets too, so a thousand of them made every
request, /health included, a plain-text 503. Concurrent requests are capped in the ASGI gate instead
(middleware.py), which exempts /health.
"""
from __future__ import annotations

import asyncio
import json
import resource
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from specdecode.entrypoints.openai.errors import RETRY_AFTER_BUSY, APIError

DEFAULT_HEAD_TIMEOUT = 10.0
DEFAULT_KEEP_ALIVE = 5.0
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_HEAD_BYTES = 32 * 1024
_LINGER = 2.0  # seconds a refused connection's further bytes are read and dropped before it is closed


@dataclass(frozen=True)
class ConnectionLimits:
    head_timeout: float = DEFAULT_HEAD_TIMEOUT        # seconds from connect (or the last response) to a whole head
    max_connections: int = DEFAULT_MAX_CONNECTIONS    # open connections, idle ones are closed first beyond it
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES      # request line and headers


def _raw_response(status: int, reason: str, err: APIError) -> bytes:
    """A whole HTTP/1.1 response written before (or without) any request event: h11 only answers requests."""
    body = json.dumps(err.body()).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *(f"{k}: {v}" for k, v in (err.headers or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with :class:`ConnectionLimits` (pass it as ``uvicorn.Config(http=...)``)."""

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._head_timer: asyncio.TimerHandle | None = None
            self._head_bytes, self._tail = 0, b""  # bytes of the head so far, and its last three
            self._idle_since = 0.0
            self._refused = False

        # ---- state
        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_bytes, self._tail = 0, b""
                self._head_timer = self.loop.call_later(limits.head_timeout, self._head_expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _refuse(self, status: int, reason: str, err: APIError) -> None:
            """Answers and ends the connection. What the client still sends is read and dropped for a moment:
            closing with unread data would reset the connection, and the client might lose the answer."""
            self._disarm()
            if self.transport.is_closing():
                return
            self.transport.write(_raw_response(status, reason, err))
            self._refused = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(_LINGER, self.transport.close)
            else:
                self.transport.close()

        # ---- events
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._idle_since = self.loop.time()
            self._arm()
            if len(self.connections) > limits.max_connections:
                self._make_room()

        def _make_room(self) -> None:
            """Closes the connection idle the longest (no request in progress: it sent nothing yet, only part of
            a head, or waits between requests) or, when every other one is busy, answers this one 503."""
            idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                    and c._between_requests()]
            if idle:
                victim = min(idle, key=lambda c: c._idle_since)
                victim._disarm()
                victim.transport.close()
                return
            self._refuse(503, "Service Unavailable", APIError(
                503, f"The server has {limits.max_connections} connections open, each with a request in progress; "
                     "retry shortly.", code="server_busy", headers={"Retry-After": RETRY_AFTER_BUSY}))

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._between_requests():
                self._arm()  # the next request's head, on a kept-alive connection too
            if self._head_timer is not None:
                # measured before h11 sees it: a head that ends within this data would otherwise be served
                seen = self._tail + data
                end = seen.find(b"\r\n\r\n")
                size = self._head_bytes + (len(data) if end < 0 else end + 4 - len(self._tail))
                if size > limits.max_head_bytes:
                    return self._refuse(431, "Request Header Fields Too Large", APIError(
                        431, f"The request line and headers are larger than the server's limit of "
                             f"{limits.max_head_bytes} bytes.", code="request_header_fields_too_large"))
                self._head_bytes, self._tail = size, seen[-3:]
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:  # a whole head arrived: the request is the app's now
                self._disarm()

        def on_response_complete(self) -> None:
            self._idle_since = self.loop.time()
            super().on_response_complete()
            if not self.transport.is_closing() and self._between_requests():
                self._arm()  # uvicorn's keep-alive timer runs too; this one also bounds a head begun later

        def _head_expired(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or not self._between_requests():
                return
            if self._head_bytes:
                self._refuse(408, "Request Timeout", APIError(
                    408, f"The request line and headers did not arrive within {limits.head_timeout:g} s.",
                    code="request_timeout"))
            else:
                self.transport.close()  # connected and sent nothing: nobody to answer

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


def raise_open_files_limit(needed: int) -> None:
    """Lifts the soft limit on open files towards ``needed`` (within the hard limit): with the common soft
    limit of 1024, accept() would fail before --max-connections is reached."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (OSError, ValueError):
        pass  # keep the limit the process has
