"""Request bodies of OpenAI's Responses API (``POST /v1/responses``, pydantic v2), and their translation to a chat
completion request.

A Responses request runs the chat route's path (template, tool prompt, tool-call grammar, sampling): its input
items become chat messages (:meth:`ResponsesRequest.chat_messages`) and :meth:`ResponsesRequest.to_chat` makes the
chat request. A field this server does not implement is refused by name, as on the other routes. Accepted
although they change nothing here: ``metadata`` (echoed back), ``user``, ``safety_identifier`` and
``prompt_cache_key`` (every prompt's prefix is cached anyway), ``truncation: "disabled"`` (what this server does),
a function tool's ``strict`` (a forced call always follows its schema), and the ids, statuses and annotations of
output items sent back as input.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag

from specdecode.entrypoints.openai.protocol import ChatCompletionRequest, ParamError, _Request, chat_request_from


class _Body(_Request):
    # JSON types as sent ("8" is not a number here, nor "yes" a boolean)
    model_config = ConfigDict(strict=True)


class TextPart(_Body):
    """A text content part: ``input_text`` (user, system, developer) or ``output_text`` (an assistant's output
    sent back; its annotations and logprobs are accepted and not read)."""
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    """An earlier call of the model's, sent back with the conversation."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class InputTextPart(_Body):
    type: Literal["input_text"]
    text: str


class FunctionCallOutputItem(_Body):
    """A function's result for the call ``call_id``."""
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_kind(item: Any) -> str | None:
    """An input item's type; a message may leave it out (OpenAI's "easy" input message)."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")]],
                      Discriminator(_item_kind)]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """``text.format``: plain text, any JSON object, or JSON following ``schema`` (enforced by the grammar)."""
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses."""
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]  # an empty list leaves nothing to answer
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["disabled"] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The input items as chat messages (without the instructions): an assistant's function calls join its
        message as tool_calls, each function output is a tool message."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for item in self.input:
            if item.type == "message":
                out.append({"role": item.role, "content": item.text()})
            elif item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out

    def _format(self) -> dict[str, Any] | None:
        """text.format as the chat request's response_format (None for plain text)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        if fmt.json_schema is None or not fmt.name:
            raise ParamError("text.format", "text.format of type 'json_schema' needs its 'name' and 'schema'.")
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.json_schema}}

    def to_chat(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request: the instructions, then ``history`` (the conversation of
        previous_response_id, if any), then this input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        choice = self.tool_choice
        fields: dict[str, Any] = dict(
            model=self.model, messages=system + history + self.chat_messages(), max_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, response_format=self._format(),
            tools=[{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                   for t in self.tools] if self.tools else None,
            tool_choice={"type": "function", "function": {"name": choice.name}} if isinstance(choice, FunctionChoice)
            else choice, parallel_tool_calls=self.parallel_tool_calls)
        return chat_request_from(fields)


def output_as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as chat messages, for the conversation a later previous_response_id continues."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                       "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return [msg]
