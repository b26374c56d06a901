"""Chat templates rendered with jinja2 alone, as transformers renders them, so a served chat needs no
transformers import (about a second of start-up).

What a template sees follows transformers 5's ``apply_chat_template(..., tokenize=False)``:
- the messages, as plain JSON data, with keys whose value is None dropped (OpenAI clients send
  ``"content": null`` next to tool calls);
- a message's reasoning under ``reasoning_content``, ``thinking`` and ``reasoning`` alike;
- ``tools``, ``documents`` (None here), ``add_generation_prompt``;
- the special tokens by name (``bos_token``, ``eos_token``, ...), which keyword arguments override;
- ``tojson`` without HTML escaping, ``raise_exception``, ``strftime_now``, ``{% generation %}`` blocks and
  loop controls, in a sandbox with blocks trimmed.
``tests/test_tokenizer.py`` renders conversations with both and compares the strings.
"""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's tokens for training masks; rendering
    only needs its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names, so a template cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 -- ``self`` may be a keyword, as in jinja
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, namespace=_Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=lambda *a, **kw: dict(*a, **kw))
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """JSON-typed copy: the template sees plain data and can never edit the caller's messages."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if type(value).__module__ == "numpy" and callable(getattr(value, "item", None)):
        return _plain(value.item())
    for base in (str, int, float):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic messages, e.g. the openai client's
        return _plain(value.model_dump())
    raise TypeError(f"a chat message holds a {type(value).__name__}, which a chat template cannot read")


def _message(m: Any) -> dict[str, Any]:
    if callable(getattr(m, "model_dump", None)):
        m = m.model_dump()
    if not isinstance(m, Mapping):
        raise TypeError(f"Chat messages should be dicts, got {m!r}.")
    m = {k: _plain(v) for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in REASONING_KEYS if m.get(k) is not None), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


def render(template: str, messages: list[Any], *, tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = False, special_tokens: Mapping[str, str] | None = None,
           **kwargs: Any) -> str:
    """One conversation rendered by ``template``; ``kwargs`` (e.g. ``enable_thinking``) reach it as variables."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    context = {**(special_tokens or {}), **_plain(kwargs)}
    return compile_template(template).render(messages=[_message(m) for m in messages], tools=_plain(tools),
                                             documents=None, add_generation_prompt=add_generation_prompt,
                                             **context)
