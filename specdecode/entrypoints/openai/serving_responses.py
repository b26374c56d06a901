"""``/v1/responses``: OpenAI's Responses API, whole or streamed, with function tools and stored responses.

A request is translated to a chat completion request (protocol_responses.py) and runs the chat route's path: the
same chat template, tool prompt, tool-call grammar (tool_choice required / named), text.format grammar, engine
admission, metrics and prefix cache. Responses are kept in memory (the last :data:`MAX_STORED`, with
``store``, the default) so that ``previous_response_id`` can continue a conversation and
``GET /v1/responses/{id}`` can read one back; a server restart forgets them.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from specdecode.engine.async_engine import RequestStream
from specdecode.entrypoints.openai.errors import APIError
from specdecode.entrypoints.openai.protocol import ChatCompletionRequest, ParamError
from specdecode.entrypoints.openai.protocol_responses import ResponsesRequest, output_as_messages
from specdecode.entrypoints.openai.serving_chat import OpenAIServingChat, reply_deltas
from specdecode.outputs import RequestOutput
from specdecode.sampling_params import SamplingParams

MAX_STORED = 1000  # stored responses kept (the oldest goes first): a bound on the memory they take

# The chat request's field names in errors, as a Responses request calls them (first match, by prefix).
_RENAMES = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
            ("max_tokens", "max_output_tokens"), ("messages", "input"), ("tool_choice.function.", "tool_choice."))


def _renamed(err: APIError) -> APIError:
    """``err`` naming the Responses request's field where it named the chat request's."""
    param = err.param or ""
    for chat_name, name in _RENAMES:
        if param.startswith(chat_name):
            err.param = name + param[len(chat_name):]
            break
    else:
        if param.startswith("tools.") and param.endswith(".function.parameters"):
            err.param = param.replace(".function.parameters", ".parameters")
    return err


def _usage(out: RequestOutput) -> dict[str, Any]:
    """The Responses usage; ``cached_tokens`` are the prompt tokens whose KV came from the prefix cache."""
    prompt = len(out.prompt_token_ids)
    made = sum(len(c.token_ids) for c in out.outputs)
    cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": made, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + made}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A parsed tool call (OpenAI chat's shape) as a function_call output item."""
    suffix = call["id"].removeprefix("call_")
    return {"type": "function_call", "id": f"fc_{suffix}", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


class _Sequenced:
    """A stream's events, numbered as the Responses API numbers them (``sequence_number``)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.n, **data}
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def error(self, err: APIError) -> str:
        return self(kind="error", code=err.code, message=err.message, param=err.param)


class OpenAIServingResponses(OpenAIServingChat):
    """The Responses API over the chat route's machinery, with the stored responses."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # id -> (the conversation so far as chat messages, without instructions; the response object)
        self.stored: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()

    def _history(self, body: ResponsesRequest) -> list[dict[str, Any]]:
        if body.previous_response_id is None:
            return []
        found = self.stored.get(body.previous_response_id)
        if found is None:
            raise APIError(400, f"Previous response with id {body.previous_response_id!r} not found (this server keeps "
                                f"the last {MAX_STORED} responses stored with store=true, in memory).",
                           param="previous_response_id", code="previous_response_not_found")
        return found[0]

    async def create_response(self, body: ResponsesRequest, request: Request) -> Response:
        history = self._history(body)
        rid = f"resp_{uuid.uuid4().hex}"
        try:
            chat = body.to_chat(history)
            model, params, streams = await self.begin(chat, rid, max_tokens_param="max_output_tokens")
        except ParamError as e:
            raise _renamed(APIError(400, str(e), param=e.param, code="invalid_value")) from None
        except APIError as e:
            raise _renamed(e) from None
        shell = self._shell(rid, model, body)
        conversation = history + body.chat_messages()
        seq = _Sequenced()
        return await self.respond(request, streams, body.stream,
                                  lambda: self._events(shell, chat, params, streams[0], seq, body, conversation),
                                  lambda outs: self._finish(shell, chat, outs[0], body, conversation),
                                  error_event=seq.error, done="")

    def _shell(self, rid: str, model: str, body: ResponsesRequest) -> dict[str, Any]:
        """The response object before any output: the request's settings, echoed as the API does."""
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) \
            if body.text is not None and body.text.format is not None else {"type": "text"}
        choice = body.tool_choice
        return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "error": None, "incomplete_details": None, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {}, "model": model,
                "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "store": body.store,
                "temperature": body.temperature, "top_p": body.top_p, "text": {"format": fmt},
                "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str)
                else (choice or "auto"),
                "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()], "truncation": "disabled",
                "usage": None, "user": body.user}

    def _complete(self, shell: dict[str, Any], out: RequestOutput, output: list[dict[str, Any]],
                  body: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response object (stored when the request asks)."""
        truncated = out.outputs[0].finish_reason == "length"
        resp = dict(shell, status="incomplete" if truncated else "completed", output=output, usage=_usage(out),
                    incomplete_details={"reason": "max_output_tokens"} if truncated else None)
        if body.store:
            self.stored[resp["id"]] = (conversation + output_as_messages(output), resp)
            while len(self.stored) > MAX_STORED:
                self.stored.popitem(last=False)
        return resp

    def _finish(self, shell: dict[str, Any], chat: ChatCompletionRequest, out: RequestOutput,
                body: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        c = out.outputs[0]
        parser = self.tool_parser(chat)
        text, calls = parser.parse(c.text) if parser is not None else (c.text, [])
        status = "incomplete" if c.finish_reason == "length" else "completed"
        output = ([_message_item(f"msg_{uuid.uuid4().hex}", text, status)] if text else []) + \
            [_call_item(call) for call in calls]
        return self._complete(shell, out, output, body, conversation)

    async def _events(self, shell: dict[str, Any], chat: ChatCompletionRequest, params: SamplingParams,
                      stream: RequestStream, seq: _Sequenced, body: ResponsesRequest,
                      conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        yield seq("response.created", response=shell)
        yield seq("response.in_progress", response=shell)
        output: list[dict[str, Any]] = []
        message: dict[str, Any] | None = None  # the text item being streamed
        text: list[str] = []

        def close_message(status: str) -> list[str]:
            item = _message_item(message["id"], "".join(text), status)
            part = item["content"][0]
            index = len(output)
            output.append(item)
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            return [seq("response.output_text.done", **where, text=part["text"], logprobs=[]),
                    seq("response.content_part.done", **where, part=part),
                    seq("response.output_item.done", output_index=index, item=item)]

        final = None
        async for delta, calls, out in reply_deltas(stream, params, self.tool_parser(chat)):
            final = out
            if delta:
                if message is None:
                    message = _message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")
                    message["content"] = []
                    yield seq("response.output_item.added", output_index=len(output), item=message)
                    yield seq("response.content_part.added", item_id=message["id"], output_index=len(output),
                              content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                     "logprobs": []})
                text.append(delta)
                yield seq("response.output_text.delta", item_id=message["id"], output_index=len(output),
                          content_index=0, delta=delta, logprobs=[])
            for call in calls:
                if message is not None:
                    for event in close_message("completed"):
                        yield event
                    message, text = None, []
                item = _call_item(call)
                index = len(output)
                yield seq("response.output_item.added", output_index=index,
                          item=dict(item, arguments="", status="in_progress"))
                yield seq("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=item["arguments"])
                yield seq("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=item["name"], arguments=item["arguments"])
                output.append(item)
                yield seq("response.output_item.done", output_index=index, item=item)
        truncated = final.outputs[0].finish_reason == "length"
        if message is not None:
            for event in close_message("incomplete" if truncated else "completed"):
                yield event
        resp = self._complete(shell, final, output, body, conversation)
        yield seq("response.incomplete" if truncated else "response.completed", response=resp)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        found = self.stored.get(response_id)
        if found is None:
            raise APIError(404, f"No response with id {response_id!r} is stored here (the last {MAX_STORED} "
                                "responses created with store=true are kept, in memory).", param="response_id",
                           code="not_found")
        return found[1]


def register(app: FastAPI, **serving_args: Any) -> None:
    serving = OpenAIServingResponses(**serving_args)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await serving.create_response(body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict:
        return serving.retrieve(response_id)
