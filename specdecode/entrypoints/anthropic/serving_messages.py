"""``/v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API, whole or streamed.

A request is translated to a chat completion request (protocol.py) and runs the chat route's path: the same
chat template, tool prompt, tool-call grammar (tool_choice any / tool), engine admission, metrics and prefix
cache. Only the answer's shape differs: content blocks, Anthropic's stop reasons and usage, its stream events
and its error envelope.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from specdecode.engine.async_engine import RequestStream
from specdecode.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from specdecode.entrypoints.openai.errors import ERROR_SHAPES, APIError
from specdecode.entrypoints.openai.protocol import ChatCompletionRequest, ParamError
from specdecode.entrypoints.openai.serving_chat import OpenAIServingChat, reply_deltas
from specdecode.outputs import CompletionOutput, RequestOutput
from specdecode.sampling_params import SamplingParams
from specdecode.tokenizer import encode_text

PATH = "/v1/messages"

# HTTP status -> Anthropic's error type (its documented pairs; other statuses by class)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error_body(err: APIError) -> dict:
    """``{"type": "error", "error": {"type", "message"}}``, Anthropic's error envelope."""
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def event(kind: str, data: dict) -> str:
    """A server-sent event as Anthropic sends them: the event name, then its data (which repeats the type)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_event(err: APIError) -> str:
    return event("error", {"error": error_body(err)["error"]})


def usage(out: RequestOutput) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens computed for this request and
    ``cache_read_input_tokens`` those whose KV came from the prefix cache (their sum is the prompt's length)."""
    cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
    return {"input_tokens": len(out.prompt_token_ids) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": sum(len(c.token_ids) for c in out.outputs)}


def stop_reason(c: CompletionOutput, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence): a stop string matched is "stop_sequence" with the string; the model's
    own end (or the grammar's) is "end_turn", or "tool_use" when the reply called tools; "max_tokens"."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.finish_reason == "stop" and isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    if c.finish_reason == "stop":
        return ("tool_use" if called else "end_turn"), None
    return None, None


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed tool call (OpenAI's shape) as a tool_use block; its input is the arguments object."""
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": fn["name"],
            "input": args if isinstance(args, dict) else {}}


class AnthropicServingMessages(OpenAIServingChat):
    """The Messages API over the chat route's machinery."""

    @staticmethod
    def _chat(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
        try:
            return body.to_chat()
        except ParamError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None

    async def create_message(self, body: MessagesRequest, request: Request) -> Response:
        chat = self._chat(body)
        rid = f"msg_{uuid.uuid4().hex[:24]}"
        model, params, streams = await self.begin(chat, rid, max_tokens_param=None)
        return await self.respond(request, streams, body.stream,
                                  lambda: self._events(rid, model, chat, params, streams[0]),
                                  lambda outs: self._message(rid, model, chat, outs[0]),
                                  error_event=_error_event, done="")

    def _message(self, rid: str, model: str, chat: ChatCompletionRequest, out: RequestOutput) -> dict:
        c = out.outputs[0]
        parser = self.tool_parser(chat)
        text, calls = parser.parse(c.text) if parser is not None else (c.text, [])
        content = ([{"type": "text", "text": text}] if text else []) + [tool_use(call) for call in calls]
        reason, sequence = stop_reason(c, bool(calls))
        return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage(out)}

    async def _events(self, rid: str, model: str, chat: ChatCompletionRequest, params: SamplingParams,
                      stream: RequestStream) -> AsyncIterator[str]:
        index, text_open, called, final = -1, False, False, None
        async for delta, calls, out in reply_deltas(stream, params, self.tool_parser(chat)):
            if final is None:
                # message_start waits for the first output: its usage carries the prompt's (cached) token counts
                start_usage = dict(usage(out), output_tokens=0)
                yield event("message_start", {"message": {
                    "id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": start_usage}})
            if delta:
                if not text_open:
                    index, text_open = index + 1, True
                    yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": delta}})
            for call in calls:
                if text_open:
                    yield event("content_block_stop", {"index": index})
                    text_open = False
                block = tool_use(call)
                index, called = index + 1, True
                yield event("content_block_start", {"index": index, "content_block": dict(block, input={})})
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                yield event("content_block_stop", {"index": index})
            final = out
        if text_open:
            yield event("content_block_stop", {"index": index})
        reason, sequence = stop_reason(final.outputs[0], called)
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage(final)})
        yield event("message_stop", {})

    async def count_tokens(self, body: CountTokensRequest) -> dict:
        self.check_model(body.model)
        prompt = await run_in_threadpool(self.chat_prompt, self._chat(body))
        ids = await run_in_threadpool(encode_text, self.tokenizer, prompt)
        return {"input_tokens": len(ids)}


def register(app: FastAPI, **serving_args: Any) -> None:
    ERROR_SHAPES[PATH] = error_body
    serving = AnthropicServingMessages(**serving_args)

    @app.post(PATH)
    async def messages(body: MessagesRequest, request: Request):
        return await serving.create_message(body, request)

    @app.post(f"{PATH}/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict:
        return await serving.count_tokens(body)
