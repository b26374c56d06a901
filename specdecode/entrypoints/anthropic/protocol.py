"""Request bodies of Anthropic's Messages API (pydantic v2), and their translation to a chat completion request.

The server answers a Messages request by rendering the same chat template, with the same tool prompt, tool-call
grammar and sampling as /v1/chat/completions: :meth:`MessagesRequest.to_chat` maps one onto the other. As on the
OpenAI routes, a field this server does not implement is refused by name (the shared request base forbids
extra fields). Accepted although they change nothing here: ``metadata`` (a user id for abuse tracking),
``cache_control`` on the request, blocks and tools (prompt caching is automatic: every prompt's prefix is cached),
a tool's ``strict`` (a forced call always follows its schema) and a text block's ``citations``.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, model_validator

from specdecode.entrypoints.openai.protocol import (MAX_STOP_STRINGS, ChatCompletionRequest, ParamError, _Request,
                                                    chat_request_from)


class _Body(_Request):
    # JSON types as sent: "8" is not a number here, nor "yes" a boolean (Anthropic's API refuses both too)
    model_config = ConfigDict(strict=True)


class CacheControl(_Body):
    """A prompt-caching breakpoint; accepted and not needed (the prefix cache keeps every prompt's blocks)."""
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # an earlier answer's sources, sent back: not shown to the model


class ToolUseBlock(_Body):
    """An earlier call of the assistant's, shown to the model in the conversation."""
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Body):
    """A tool's answer to the call ``tool_use_id``; ``is_error`` marks its text as an error report."""
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Body):
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None
    strict: bool | None = None  # forced calls (tool_choice any / tool) always follow the schema: the grammar


class ToolChoice(_Body):
    """auto: the model may call a tool; any: it must call one; tool: it must call ``name``; none: no calls.
    ``any`` and ``tool`` are enforced by the tool-call grammar, as tool_choice required / named on the chat route."""
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_only_for_tool(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the name of the tool to call.")
        if self.type != "tool" and self.name is not None:
            raise ValueError(f"tool_choice.name is read only with type 'tool', got type {self.type!r}.")
        return self

    def as_openai(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class Metadata(_Body):
    """Accepted for compatibility; this server keeps no per-user records."""
    user_id: str | None = None


class _Conversation(_Body):
    """What both /v1/messages and /v1/messages/count_tokens take: the conversation and its tools."""
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def _chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat-completion messages: tool_use blocks become the assistant's tool_calls, each
        tool_result block a tool message, and a message's text blocks one text joined by newlines."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            texts, calls = [], []
            for j, block in enumerate(m.content):
                where = f"messages.{i}.content.{j}"
                if block.type == "text":
                    texts.append(block.text)
                elif block.type == "tool_use":
                    if m.role != "assistant":
                        raise ParamError(where, f"{where}: tool_use blocks belong in assistant messages.")
                    calls.append({"id": block.id, "type": "function",
                                  "function": {"name": block.name, "arguments": json.dumps(block.input)}})
                else:
                    if m.role != "user":
                        raise ParamError(where, f"{where}: tool_result blocks belong in user messages.")
                    if texts:
                        raise ParamError(where, f"{where}: tool_result blocks come first in a user message, before "
                                                "its text.")
                    out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            if m.role == "assistant":
                msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
            elif texts or not m.content:
                out.append({"role": "user", "content": "\n".join(texts)})
        return out

    def to_chat(self, **sampling: Any) -> ChatCompletionRequest:
        """The chat completion request with this conversation, its tools and ``sampling`` (chat request fields).
        A final assistant message is a prefill: the reply goes on from its text."""
        last = self.messages[-1]
        prefill = last.role == "assistant"
        if prefill and not isinstance(last.content, str) and any(b.type != "text" for b in last.content):
            raise ParamError(f"messages.{len(self.messages) - 1}.content",
                             "A final assistant message is a prefill the reply continues: it may hold text only.")
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.input_schema}} for t in self.tools or ()]
        choice = self.tool_choice
        fields: dict[str, Any] = dict(
            model=self.model, messages=self._chat_messages(), tools=tools or None,
            tool_choice=choice.as_openai() if choice is not None else None,
            parallel_tool_calls=False if choice is not None and choice.disable_parallel_tool_use else None,
            continue_final_message=prefill, add_generation_prompt=not prefill, **sampling)
        return chat_request_from(fields)


class MessagesRequest(_Conversation):
    """POST /v1/messages."""
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None

    def to_chat(self) -> ChatCompletionRequest:  # type: ignore[override]
        return super().to_chat(max_tokens=self.max_tokens, stop=self.stop_sequences, temperature=self.temperature,
                               top_p=self.top_p, top_k=self.top_k)


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the prompt tokens the same conversation would take."""
