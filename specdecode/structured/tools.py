"""Tool calling: tool-call parsers that turn a model's output into OpenAI ``tool_calls``, each with the grammar
that enforces tool_choice "required" or a named function in its format. Parsers are chosen by name, as with
vLLM's ``--tool-call-parser``; another model family's format is one ToolParser subclass registered with
``@register_tool_parser("name")``."""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Callable

from specdecode.structured.params import StructuredOutputsParams


# xgrammar's C++ core starts its messages with a log prefix, "[16:35:54] /project/cpp/regex_converter.cc:83: ".
_XGRAMMAR_LOG_PREFIX = re.compile(r"\[\d{1,2}:\d{2}:\d{2}\] [^\s:]+:\d+: ")


def xgrammar_message(text: str) -> str:
    """An xgrammar error message without the log prefix (a time and a C++ source path, which mean nothing to
    whoever sent the schema or grammar): the library's own words are kept."""
    return _XGRAMMAR_LOG_PREFIX.sub("", text)


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"]}


def tool_call_constraint(tools: list[dict[str, Any]], name: str | None = None,
                         parallel: bool = True) -> StructuredOutputsParams:
    """The grammar of an answer made only of Hermes-style tool calls (``<tool_call>\\n{"name": ..., "arguments":
    {...}}\\n</tool_call>``, what Qwen2.5's template teaches), to one of ``tools`` or to the function ``name``;
    several calls unless ``parallel`` is False. The arguments follow each function's JSON schema."""
    import xgrammar as xgr

    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    schema = _call_schema(chosen[0]) if len(chosen) == 1 else {"anyOf": [_call_schema(t) for t in chosen]}
    try:
        rules = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    except Exception as e:  # noqa: BLE001 - xgrammar's message names what is wrong with the schema
        raise ValueError(f"Invalid tool parameters schema: {xgrammar_message(str(e).strip().splitlines()[0])}") \
            from None
    rules = re.sub(r"\broot\b", "tool_call_json", rules)
    top = 'root ::= tool_call ("\\n" tool_call)*' if parallel else "root ::= tool_call"
    grammar = f'{top}\ntool_call ::= "<tool_call>\\n" tool_call_json "\\n</tool_call>"\n{rules}'
    return StructuredOutputsParams(grammar=grammar)


def _new_call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


class ToolParser:
    """Finds tool calls in a model's output. ``parse`` takes a whole answer; ``stream`` takes text deltas and
    holds back what may still be the start of a call, so streamed content never contains call markup;
    ``constraint`` is the grammar of an answer made only of calls in this format. With ``max_calls``
    (``parallel_tool_calls: false``) the calls after that many are dropped, markup and all."""

    name = ""

    def __init__(self, max_calls: int | None = None):
        self._buf = ""
        self._calls = 0
        self.max_calls = max_calls

    def _room(self, calls: int) -> bool:
        """Whether one more call may be returned after ``calls`` calls."""
        return self.max_calls is None or calls < self.max_calls

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content outside the calls, or None when empty; the calls in OpenAI's shape)."""
        raise NotImplementedError

    def stream(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, complete calls to send now, each with its ``index``)."""
        raise NotImplementedError

    @classmethod
    def constraint(cls, tools: list[dict[str, Any]], name: str | None = None,
                   parallel: bool = True) -> StructuredOutputsParams:
        """The output constraint for tool_choice "required" (``name`` None) or a named function: only calls, in
        this parser's format, whose arguments follow the functions' parameter schemas."""
        raise NotImplementedError


TOOL_PARSERS: dict[str, type[ToolParser]] = {}
DEFAULT_TOOL_PARSER = "hermes"  # what "auto" means: the format of Qwen2.5 / Qwen3, the default models' family


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: makes a ToolParser available under ``name`` (--tool-call-parser NAME)."""
    def register(cls: type[ToolParser]) -> type[ToolParser]:
        cls.name = name
        TOOL_PARSERS[name] = cls
        return cls
    return register


def tool_parser_names() -> tuple[str, ...]:
    return ("auto",) + tuple(sorted(TOOL_PARSERS))


def resolve_tool_parser(name: str) -> type[ToolParser]:
    """The parser class for a name ("auto": the default); ValueError naming the valid ones otherwise."""
    key = str(name).strip().lower()
    cls = TOOL_PARSERS.get(DEFAULT_TOOL_PARSER if key == "auto" else key)
    if cls is None:
        raise ValueError(f"Unknown tool call parser {name!r}; valid parsers: {', '.join(tool_parser_names())}.")
    return cls


def get_tool_parser(name: str, max_calls: int | None = None) -> ToolParser:
    """A fresh parser (parsers keep streaming state: one per answer)."""
    return resolve_tool_parser(name)(max_calls)


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen2.5, Qwen3)."""
    START, END = "<tool_call>", "</tool_call>"
    constraint = staticmethod(tool_call_constraint)
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def _call(self, body: str) -> dict[str, Any] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return _new_call(obj["name"], obj.get("arguments", obj.get("parameters", {})))

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        calls, content, pos = [], [], 0
        for m in self._BLOCK.finditer(text):
            call = self._call(m.group(1))
            if call is None:
                continue  # not a valid call: it stays in the content, as the model wrote it
            content.append(text[pos:m.start()])
            if self._room(len(calls)):
                calls.append(call)
            pos = m.end()
        content.append(text[pos:])
        rest = "".join(content).strip() if calls else "".join(content)
        return (rest or None), calls

    def stream(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        self._buf += delta
        out, calls = [], []
        while True:
            start = self._buf.find(self.START)
            if start < 0:
                # keep a tail that may be the beginning of "<tool_call>"
                keep = 0 if final else next((k for k in range(min(len(self.START) - 1, len(self._buf)), 0, -1)
                                             if self.START.startswith(self._buf[-k:])), 0)
                out.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            out.append(self._buf[:start])
            end = self._buf.find(self.END, start)
            if end < 0:
                if final:  # an unfinished call is text
                    out.append(self._buf[start:])
                    self._buf = ""
                else:
                    self._buf = self._buf[start:]
                break
            call = self._call(self._buf[start + len(self.START):end].strip())
            if call is None:
                out.append(self._buf[start:end + len(self.END)])
            elif self._room(self._calls):
                calls.append({"index": self._calls, **call})
                self._calls += 1
            self._buf = self._buf[end + len(self.END):]
        text = "".join(out)
        if calls or self._calls:
            text = text.strip("\n") if text.strip() == "" else text
        return text, calls

