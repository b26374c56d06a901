"""Tool calls written as a bare JSON object, the way small models answer under tool_choice "auto".

Asked "What is the weather in Paris?" with a ``get_weather`` tool, Qwen2.5-Coder 1.5B does not write Qwen's
``<tool_call>`` tags: it answers with one JSON object, usually in a ```json fence, holding ``name`` and
``arguments``. Agent frameworks default to "auto", so without this their tool loop never starts.

A reply counts as a call only when it is *exactly* one JSON object (fenced or not, nothing else around it) whose
``name`` is one of the request's tools and whose ``arguments`` validate against that tool's ``parameters``
schema. Anything else stays text: example JSON a user asked for names no tool, or has other keys, or does not
fit the schema. The decision reads only the generated text, so it is as exact under speculation as the text is.
Models that use the tags are parsed by the tool-call parser first and never reach this.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

from specdecode.structured.tools import ToolParser, _new_call

# ```json ... ``` (or a bare ``` fence) around the whole reply
_FENCE_OPEN = re.compile(r"```(?:json|JSON)?[ \t]*\n?")
_FENCE_CLOSE = "```"
_CALL_KEYS = ({"name", "arguments"}, {"name", "parameters"})


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str):
    import jsonschema

    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema)


def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not a valid JSON schema (the validator's words), or None when it is."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        return f"must be a JSON schema object, got {type(schema).__name__}."
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "".join(f"[{p!r}]" for p in e.absolute_path)
        return f"is not a valid JSON schema: {e.message}" + (f" (at {where})." if where else ".")
    return None


def _arguments_fit(arguments: Any, schema: dict[str, Any] | None) -> bool:
    if not isinstance(arguments, dict):
        return False
    if not schema:
        return True
    return _validator(json.dumps(schema, sort_keys=True)).is_valid(arguments)


def _unfence(text: str) -> str | None:
    """The reply without a fence around the whole of it; None when the fence is not closed."""
    t = text.strip()
    m = _FENCE_OPEN.match(t)
    if m is None:
        return t
    inner = t[m.end():]
    if not inner.rstrip().endswith(_FENCE_CLOSE):
        return None
    return inner.rstrip()[:-len(_FENCE_CLOSE)]


def tool_schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """name -> parameters schema of each tool of a request (``tools`` as the chat template takes them)."""
    return {t["function"]["name"]: t["function"].get("parameters") for t in tools}


def json_call(text: str, tools: dict[str, dict[str, Any] | None]) -> dict[str, Any] | None:
    """The call ``text`` makes when it is exactly one JSON object naming one of ``tools`` (name -> its
    parameters schema) with arguments that fit that schema; None when it is anything else."""
    body = _unfence(text)
    if body is None or not body.strip().startswith("{"):
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or set(obj) not in _CALL_KEYS:
        return None
    name = obj["name"]
    arguments = obj.get("arguments", obj.get("parameters"))
    if not isinstance(name, str) or name not in tools or not _arguments_fit(arguments, tools[name]):
        return None
    return _new_call(name, arguments)


def answered_calls(messages: list[Any]) -> list[tuple[str, Any]]:
    """(name, arguments) of each call of the conversation's last assistant message when only tool results follow
    it: the calls whose results the model is about to read. ``messages``: chat messages (role, tool_calls)."""
    tail = len(messages)
    while tail and messages[tail - 1].role == "tool":
        tail -= 1
    if tail in (0, len(messages)) or messages[tail - 1].role != "assistant":
        return []
    answered = []
    for c in messages[tail - 1].tool_calls or []:
        try:
            answered.append((c.function.name, json.loads(c.function.arguments)))
        except ValueError:
            pass
    return answered


def repeats_answered_call(text: str, tools: dict[str, dict[str, Any] | None],
                          answered: list[tuple[str, Any]]) -> bool:
    """Whether ``text`` is a bare JSON call (:func:`json_call`) identical to one of the ``answered`` calls."""
    call = json_call(text, tools)
    return call is not None and (call["function"]["name"], json.loads(call["function"]["arguments"])) in answered


_NAME_VALUE = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_KEY_HEAD = re.compile(r'\{\s*"((?:[^"\\]|\\.)*)"')


def could_become_call(text: str, tools: dict[str, Any]) -> bool:
    """Whether more text could still make ``text`` (a reply's beginning) a call that :func:`json_call` accepts:
    what a stream holds back until it knows."""
    t = text.lstrip()
    fenced = t.startswith("`")
    if fenced:
        if "```json".startswith(t) or "```JSON".startswith(t):
            return True  # the fence, or its language tag, is still arriving
        m = _FENCE_OPEN.match(t)
        if m is None:
            return False
        t = t[m.end():].lstrip()
    if not t:
        return True
    if not t.startswith("{"):
        return False
    key = _KEY_HEAD.match(t)
    if key is None:
        return True  # '{' or '{"na': too early to tell
    if key.group(1) not in ("name", "arguments", "parameters"):
        return False  # the first key is none of a call's keys
    name = _NAME_VALUE.match(t)
    if name is not None and name.group(1) not in tools:
        return False  # it names something that is no tool
    try:
        _, end = json.JSONDecoder().raw_decode(t)
    except ValueError:
        return True  # the object is still open
    if json_call(t[:end], tools) is None:
        return False
    rest = t[end:].strip()
    return not rest or (fenced and rest.startswith(_FENCE_CLOSE[:len(rest)]) if len(rest) <= 3 else False)


class JsonCallParser(ToolParser):
    """The server's tool-call parser, and then, when it found no call, a reply that is one JSON call
    (:func:`json_call`). Streaming holds the reply back while it could still become such a call, and lets it go
    as text as soon as it cannot (or calls it at the end)."""

    def __init__(self, inner: ToolParser, tools: list[dict[str, Any]]):
        super().__init__(inner.max_calls)
        self.inner = inner
        self.name = inner.name
        self.tools = tool_schemas(tools)
        self._held = ""
        self._open = True  # still deciding: nothing has been sent yet

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        content, calls = self.inner.parse(text)
        if calls:
            return content, calls
        call = json_call(text, self.tools)
        return (None, [call]) if call is not None else (content, calls)

    def stream(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        text, calls = self.inner.stream(delta, final)
        if not self._open:
            return text, calls
        if calls:  # the model used the parser's format: this is no bare JSON reply
            self._open = False
            text, self._held = self._held + text, ""
            return text, calls
        self._held += text
        if final:
            self._open = False
            held, self._held = self._held, ""
            call = json_call(held, self.tools)
            return ("", [{"index": 0, **call}]) if call is not None else (held, [])
        if could_become_call(self._held, self.tools):
            return "", []
        self._open = False
        held, self._held = self._held, ""
        return held, []
