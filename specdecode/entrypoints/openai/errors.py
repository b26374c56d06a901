"""Errors as OpenAI sends them: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

:class:`APIError` is what routes raise; :func:`from_exception` maps the engine's exceptions (a full queue, a
dead engine, a bad prompt) onto it, and :func:`validation_error` maps pydantic's errors for a request body,
naming the request field each is about (OpenAI's ``param``).
"""
from __future__ import annotations

import logging
import re
from typing import Callable

from fastapi.exceptions import RequestValidationError

from specdecode.engine.async_engine import EngineDeadError, EngineStepError, RequestFailedError
from specdecode.engine.scheduler import QueueFullError
from specdecode.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("specdecode.server")


class APIError(Exception):
    """Becomes ``{"error": {"message", "type", "param", "code"}}`` with the given HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
             431: "invalid_request_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or self.TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Routes whose clients read another API's error envelope (Anthropic's /v1/messages): path prefix -> the body
# an APIError becomes there. Each such API registers its shape with its routes.
ERROR_SHAPES: dict[str, Callable[[APIError], dict]] = {}


def error_body(err: APIError, path: str) -> dict:
    """The body of ``err`` as the client of the route at ``path`` reads errors (OpenAI's shape by default)."""
    for prefix, shape in ERROR_SHAPES.items():
        if path.startswith(prefix):
            return shape(err)
    return err.body()


# Seconds a client is told to wait after a 503: a full queue drains within a few engine steps; a server that
# is shutting down needs a restart (or another replica).
RETRY_AFTER_QUEUE_FULL = "1"
RETRY_AFTER_BUSY = "1"  # all the server's connections or request slots are taken: as short-lived as a full queue
RETRY_AFTER_DEAD = "10"


def from_exception(e: BaseException, prompt_param: str = "prompt") -> APIError:
    """The error response for an exception raised while serving a request (``prompt_param``: the request
    field that carries the prompt, named by errors about it)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), code="queue_full", headers={"Retry-After": RETRY_AFTER_QUEUE_FULL})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": RETRY_AFTER_DEAD})
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), code="internal_error")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), code="request_failed")
    if isinstance(e, ValueError):
        msg = str(e)
        if "max_model_len" in msg:
            return APIError(400, msg, param=prompt_param, code="context_length_exceeded")
        return APIError(400, msg, param=_engine_error_param(msg, prompt_param), code="invalid_value")
    logger.exception("Unexpected error while serving a request")
    return APIError(500, f"Internal server error ({type(e).__name__}: {e}).", code="internal_error")


# Every field of a request body: a word that starts an error message names the field only if it is one of these.
_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)


def field_param(msg: str) -> str | None:
    """The field an error message starts with ("temperature must be ...", "messages[0].content contains ..."),
    as a dotted path; None when the message does not start with a request field."""
    head = re.sub(r"\[(\d+)\]", r".\1", msg.split(" ", 1)[0]).rstrip(".:,")
    return head if head.split(".", 1)[0] in _FIELDS else None


def _engine_error_param(msg: str, prompt_param: str) -> str | None:
    """The request field an engine ValueError at admission is about: the prompt (its token ids, its length),
    n (more samples than the queue takes), or a field the message starts with."""
    if msg.lower().startswith(("prompt", "the prompt")):
        return prompt_param
    if msg.startswith("n="):
        return "n"
    return field_param(msg)


def _loc_path(loc: tuple) -> str:
    """A pydantic error location as the request's field path: without "body" and without the union member
    tags pydantic puts in it ('str', 'list[ContentPart]', 'NamedToolChoice'), which are not request fields."""
    return ".".join(str(x) for x in loc if x != "body" and not (
        isinstance(x, str) and ("[" in x or x[:1].isupper() or x in ("str", "int", "float", "bool", "dict", "list"))))


def validation_error(exc: RequestValidationError) -> APIError:
    """The 400 for a request body pydantic refused: invalid JSON, unsupported fields, or invalid values (the
    first five, each under its field's path)."""
    errs = exc.errors()
    if any(err.get("type") == "json_invalid" for err in errs):
        err = next(err for err in errs if err.get("type") == "json_invalid")
        detail = (err.get("ctx") or {}).get("error", "")
        return APIError(400, f"The request body is not valid JSON ({detail}).".replace(" ()", ""),
                        code="invalid_json")
    extra = [err for err in errs if err.get("type") == "extra_forbidden"]
    if extra:
        names = [_loc_path(err.get("loc", ())) for err in extra]
        return APIError(400, f"Unsupported field{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))}: "
                        "this server does not implement "
                        f"{'them' if len(names) > 1 else 'it'}, and ignoring it would change the answer "
                        "silently. Remove it from the request.", param=names[0], code="unsupported_field")
    parts, param = [], None
    for err in errs[:5]:
        field = _loc_path(err.get("loc", ()))
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if not field and err.get("type") == "value_error":  # our own checks name the field first
            param = param or field_param(msg)
            parts.append(msg)
            continue
        param = param or (field or None)
        parts.append(f"{field or 'body'}: {msg}")
    return APIError(400, "Invalid request: " + "; ".join(parts), param=param, code="invalid_value")
