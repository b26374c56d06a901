"""The one JSON reader of every route's request body.

- Any body it cannot read (malformed, not UTF-8, nested past the parser's recursion limit) is the same 400
  ``invalid_json`` on every route, never a 500 with a traceback.
- A number written with a fraction or an exponent that is a whole number (``16.0``, ``1e3``) reads as that
  integer, as JSON Schema counts it: the request models are strict (no number from a string or a bool), and an
  integer field takes it as JSON Schema says it may. Any other number stays a float.
"""
from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Coroutine

from fastapi import Request, Response
from fastapi.routing import APIRoute

_EXACT = 2 ** 64  # whole numbers up to this are read exactly; beyond, as floats (and refused by range checks)


def _number(text: str) -> int | float:
    value = float(text)
    if value.is_integer() and abs(value) <= _EXACT:
        try:
            return int(Decimal(text))
        except InvalidOperation:  # pragma: no cover - float() read it, so Decimal does
            return value
    return value


def read_json(raw: bytes | str) -> Any:
    """The body's JSON value; json.JSONDecodeError (FastAPI's invalid-JSON error) for anything unreadable."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        raise json.JSONDecodeError(f"the body is not UTF-8 ({e.reason})", "", e.start) from None
    try:
        return json.loads(text, parse_float=_number)
    except RecursionError:  # the decoder recurses once per level of nesting
        raise json.JSONDecodeError("nested too deeply to be read", "", 0) from None


class _JsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = read_json(await self.body())
        return self._json


class JsonRoute(APIRoute):
    """FastAPI's route, reading its body with :func:`read_json` (``app.router.route_class = JsonRoute``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_JsonRequest(request.scope, request.receive))

        return route
