"""Serves the chat page: ``/`` and its few files under ``/webui/``, read from this package once, at start-up.

Only these fixed paths answer; everything else keeps the server's JSON 404. The page talks to the server's own
``/v1/chat/completions``, so the content security policy allows only this origin: model output rendered as
Markdown can neither run scripts nor load anything from elsewhere."""
from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

ASSETS = {"app.js": "text/javascript", "markdown.js": "text/javascript", "style.css": "text/css"}
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; "
                                       "base-uri 'none'; frame-ancestors 'none'"}


def _read(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


def _handler(body: bytes, media: str):
    async def serve_file() -> Response:
        return Response(body, media_type=f"{media}; charset=utf-8", headers=_HEADERS)
    return serve_file


def register(app: FastAPI) -> None:
    """Puts the page's routes on ``app``."""
    app.add_api_route("/", _handler(_read("index.html"), "text/html"), methods=["GET", "HEAD"], include_in_schema=False)
    for name, media in ASSETS.items():
        app.add_api_route(f"/webui/{name}", _handler(_read(name), media), methods=["GET", "HEAD"], include_in_schema=False)
