"""The OpenAPI document, made to say what the server does.

FastAPI's own document is derived from the request models only. This adds what they cannot say: the errors the
routes really send (400 in OpenAI's shape, not FastAPI's 422; 404 for an unknown model or stored response; the
gate's 408 / 413 / 415 / 503; Anthropic's envelope on its routes), /health's empty body and /metrics' text,
/tokenize's request body (read by hand, so FastAPI cannot see it), and the bounds the server checks once a body
has been parsed (the chat roles, content part types, token ids within this model's vocabulary, non-empty
prompts, the sampling ranges SamplingParams enforces, n within the waiting queue), so that a request the document
calls valid is one the server takes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from specdecode.entrypoints.openai.protocol import ROLES, TokenizeChatRequest, TokenizeCompletionRequest
from specdecode.entrypoints.openai.response_models import ErrorResponse


@dataclass(frozen=True)
class ServerFacts:
    """What the document's bounds depend on: the loaded model and the engine's limits (None: not stated)."""
    prompt_vocab: int | None = None      # token ids a prompt may hold
    sampling_vocab: int | None = None    # token ids stop_token_ids, allowed_token_ids, logit_bias may name
    tokenizer_vocab: int | None = None   # token ids /detokenize reads
    max_model_len: int | None = None
    max_waiting: int | None = None       # n beyond it cannot be queued


def facts_of(engine: Any) -> ServerFacts:
    """The facts of an AsyncLLMEngine's loaded engine (none for a stand-in without one)."""
    inner = getattr(engine, "engine", None)
    if inner is None:
        return ServerFacts()
    return ServerFacts(prompt_vocab=inner.input_processor.vocab_size, sampling_vocab=inner.target.vocab_size,
                       tokenizer_vocab=len(inner.tokenizer), max_model_len=inner.max_model_len,
                       max_waiting=max(inner.scheduler.max_waiting, 1))


_ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
_ANTHROPIC_ERROR = {"content": {"application/json": {"schema": {
    "type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}}}}
_POST_ERRORS = {"400": "Invalid request: malformed JSON, a wrong type, an unsupported field or a value out of range",
                "404": "The model named is not served here", "408": "The request body did not arrive in time",
                "413": "The request body is larger than the server's limit",
                "415": "The request body is not sent as JSON",
                "503": "The server is busy (its queue or request slots are full) or shutting down; see Retry-After"}
_STREAMING = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
_NOT_FOUND = {"/v1/models/{model_id}": "No model of that name is served here",
              "/v1/responses/{response_id}": "No stored response has that id"}


def _token_ids(schema: dict[str, Any], vocab: int | None) -> None:
    schema["minimum"] = 0
    if vocab is not None:
        schema["maximum"] = vocab - 1


def _walk(node: Any, fn) -> None:
    """Calls ``fn`` on every schema object under ``node``."""
    if isinstance(node, dict):
        fn(node)
        for v in node.values():
            _walk(v, fn)
    elif isinstance(node, list):
        for v in node:
            _walk(v, fn)


def _integer_items(prop: dict[str, Any]) -> list[dict[str, Any]]:
    """The integer-item schemas of an array property (under anyOf, and arrays of arrays)."""
    found = []

    def visit(s: dict[str, Any]) -> None:
        if s.get("type") == "array" and s.get("items", {}).get("type") == "integer":
            found.append(s["items"])
    _walk(prop, visit)
    return found


def _non_empty_arrays_and_strings(prop: dict[str, Any]) -> None:
    def visit(s: dict[str, Any]) -> None:
        if s.get("type") == "array":
            s["minItems"] = 1
        elif s.get("type") == "string":
            s["minLength"] = 1
    _walk(prop, visit)


# SamplingParams' ranges (specdecode/sampling_params.py), stated for the request fields that carry them
_SAMPLING_BOUNDS: dict[str, dict[str, Any]] = {
    "temperature": {"minimum": 0}, "top_p": {"exclusiveMinimum": 0, "maximum": 1}, "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1}, "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"minimum": 1e-38, "maximum": 1e38},  # it and its reciprocal finite in float32
    "seed": {"minimum": -2 ** 63, "maximum": 2 ** 64 - 1},
}


def _bound(prop: dict[str, Any], bounds: dict[str, Any]) -> None:
    """Puts numeric bounds on the number/integer branch of a property (beside its null)."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") in ("number", "integer"):
            branch.update(bounds)


def _sampling_fields(schema: dict[str, Any], facts: ServerFacts) -> None:
    props = schema.get("properties", {})
    for name, bounds in _SAMPLING_BOUNDS.items():
        if name in props:
            _bound(props[name], bounds)
    if "n" in props and facts.max_waiting is not None:
        props["n"]["maximum"] = min(props["n"].get("maximum", facts.max_waiting), facts.max_waiting)
    for name in ("stop_token_ids", "allowed_token_ids"):
        if name in props:
            for items in _integer_items(props[name]):
                _token_ids(items, facts.sampling_vocab)
    if "allowed_token_ids" in props:
        _non_empty_arrays_and_strings(props["allowed_token_ids"])
    for name in ("stop", "bad_words"):
        if name in props:
            _walk(props[name], lambda s: s.update(pattern=r"\S") if s.get("type") == "string" else None)
    if "logit_bias" in props:
        for branch in props["logit_bias"].get("anyOf", []):
            if branch.get("type") == "object":
                branch["propertyNames"] = {"pattern": r"^[0-9]{1,12}$"}
                branch["additionalProperties"] = {"type": "number", "minimum": -100, "maximum": 100}
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if name in props and facts.max_model_len is not None and schema.get("title") != "MessagesRequest":
            _bound(props[name], {"maximum": facts.max_model_len - 1})


def _request_bounds(schemas: dict[str, Any], facts: ServerFacts) -> None:
    # the Responses and Messages bodies become chat requests: the same ranges hold for the fields they carry
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "MessagesRequest"):
        if name in schemas:
            _sampling_fields(schemas[name], facts)
    if "CompletionRequest" in schemas:
        prompt = schemas["CompletionRequest"]["properties"]["prompt"]
        _non_empty_arrays_and_strings(prompt)
        for items in _integer_items(prompt):
            _token_ids(items, facts.prompt_vocab)
    if "ChatMessage" in schemas:
        schemas["ChatMessage"]["properties"]["role"]["enum"] = list(ROLES)
    if "ContentPart" in schemas:
        part = schemas["ContentPart"]
        part["properties"]["type"]["enum"] = ["text"]
        part["properties"]["text"] = {"type": "string", "title": "Text"}
        part["required"] = ["type", "text"]
    if "DetokenizeRequest" in schemas:
        _token_ids(schemas["DetokenizeRequest"]["properties"]["tokens"]["items"], facts.tokenizer_vocab)


def _add_models(schemas: dict[str, Any], *models) -> None:
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        schemas[model.__name__] = schema


def build_openapi(app: FastAPI, facts: ServerFacts) -> dict[str, Any]:
    """The document for ``app`` (cached on it)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    _add_models(schemas, ErrorResponse, TokenizeCompletionRequest, TokenizeChatRequest)
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _request_bounds(schemas, facts)
    paths = schema.setdefault("paths", {})
    for path in _STREAMING:
        if path in paths:  # with "stream": true the 200 is a stream of server-sent events
            content = paths[path]["post"]["responses"]["200"].setdefault("content", {})
            content["text/event-stream"] = {"schema": {}}  # events of the route's own chunk shapes
    for path, item in paths.items():
        error = _ANTHROPIC_ERROR if path.startswith("/v1/messages") else _ERROR
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if method == "post":
                for status, why in _POST_ERRORS.items():
                    responses[status] = dict(error, description=why)
            elif path in _NOT_FOUND:
                responses["404"] = dict(error, description=_NOT_FOUND[path])
                responses.pop("400", None)  # a path parameter is any string: nothing about it is refused
    if "/tokenize" in paths:
        paths["/tokenize"]["post"]["requestBody"] = {"required": True, "content": {"application/json": {"schema": {
            "oneOf": [{"$ref": "#/components/schemas/TokenizeCompletionRequest"},
                      {"$ref": "#/components/schemas/TokenizeChatRequest"}]}}}}
    if "/health" in paths:
        paths["/health"]["get"]["responses"] = {
            "200": {"description": "The engine is running (an empty body)"},
            "503": dict(_ERROR, description="The engine loop is not running")}
    if "/metrics" in paths:
        paths["/metrics"]["get"]["responses"] = {"200": {
            "description": "Prometheus metrics, in its text format",
            "content": {"text/plain": {"schema": {"type": "string"}}}}}
    app.openapi_schema = schema
    return schema
