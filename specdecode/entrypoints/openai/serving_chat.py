"""``/v1/chat/completions``: messages rendered by the model's chat template, the reply whole or streamed; with
tools, calls read out of the reply (and, for tool_choice required or named, enforced) by the server's
tool-call parser."""
from __future__ import annotations

import bisect
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from specdecode.engine.async_engine import RequestStream
from specdecode.entrypoints.openai.protocol import ChatCompletionRequest
from specdecode.entrypoints.openai.response_models import (ChatChoice, ChatCompletionChunk, ChatCompletionResponse,
                                                           ChatLogprobs, ChatResponseMessage, ChatStreamChoice,
                                                           DeltaMessage, TokenLogprob, TopLogprob)
from specdecode.entrypoints.openai.serving_engine import (OpenAIServing, StreamedChoice, chunk_event, spec_of,
                                                          stop_hold, usage_of)
from specdecode.outputs import CompletionOutput, RequestOutput
from specdecode.sampling_params import SamplingParams
from specdecode.structured.json_calls import (JsonCallParser, answered_calls, could_become_call,
                                               repeats_answered_call, tool_schemas)
from specdecode.structured.tools import ToolParser, get_tool_parser


class OpenAIServingChat(OpenAIServing):
    """The chat completions route: the rendered prompt, the reply and its tool calls, whole or streamed."""

    def sampling_params(self, body: ChatCompletionRequest) -> SamplingParams:
        # tool_choice required / named constrains the output to the server's tool-call format
        return body.to_sampling_params(self.tool_call_parser)

    async def begin(self, body: ChatCompletionRequest, rid: str, max_tokens_param: str | None = "max_tokens"
                    ) -> tuple[str, SamplingParams, list[RequestStream]]:
        """A chat request checked, rendered and admitted as engine request ``rid``: the model name it answers as,
        its sampling parameters and its stream. The other chat-shaped APIs (Responses, Anthropic's Messages)
        translate their bodies to a ChatCompletionRequest and start here too.

        ``max_tokens_param``: the field a max_tokens beyond what the context leaves is a 400 about, as the
        client's API calls it (max_completion_tokens when the chat request used that); None clamps it instead
        (Anthropic's required max_tokens: clients send large values routinely)."""
        model, params = await self.prepare(body)
        prompt = await run_in_threadpool(self.chat_prompt, body)  # templating is CPU work: off the event loop
        if max_tokens_param == "max_tokens" and body.max_completion_tokens is not None:
            max_tokens_param = "max_completion_tokens"
        streams = await self.start(rid, [(prompt, None)], params, "messages", max_tokens_param=max_tokens_param)
        answered = answered_calls(body.messages) if body.tool_mode == "auto" and body.n == 1 else []
        if answered:
            async def again() -> RequestStream:
                quiet = body.model_copy(update={"tool_choice": "none"})
                _, fresh = await self.prepare(quiet)  # a request's parameters are its own (the engine fills them)
                prompt = await run_in_threadpool(self.chat_prompt, quiet)
                return (await self.start(f"{rid}-r", [(prompt, None)], fresh, "messages",
                                         max_tokens_param=max_tokens_param))[0]
            streams = [UnlessRepeated(streams[0], body.tool_dicts(), answered, again)]
        return model, params, streams

    def tool_parser(self, body: ChatCompletionRequest) -> ToolParser | None:
        """A fresh parser for one reply's tool calls (None when the request has no tools in play). Under "auto"
        a reply that is one bare JSON call to a tool counts too: small models answer so (json_calls.py)."""
        if body.tool_mode == "none":
            return None
        parser = get_tool_parser(self.tool_call_parser, body.max_tool_calls)
        return JsonCallParser(parser, body.tool_dicts()) if body.tool_mode == "auto" else parser

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request) -> Response:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        model, params, streams = await self.begin(body, rid)
        return await self.respond(request, streams, body.stream,
                                  lambda: self._events(rid, model, body, params, streams[0]),
                                  lambda outs: self._response(rid, model, body, outs[0]))

    def _logprobs(self, c: CompletionOutput, start: int, end: int, top_n: int) -> ChatLogprobs:
        content = []
        for t, d in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            s = self.token_str(t)
            tops = [TopLogprob(token=self.token_str(k), logprob=v.logprob, bytes=list(self.token_str(k).encode()))
                    for k, v in sorted(d.items(), key=lambda kv: -kv[1].logprob)[:top_n]]
            content.append(TokenLogprob(token=s, logprob=d[t].logprob, bytes=list(s.encode()), top_logprobs=tops))
        return ChatLogprobs(content=content)

    def _response(self, rid: str, model: str, body: ChatCompletionRequest, out: RequestOutput) -> dict:
        choices = []
        for c in out.outputs:
            lp = self._logprobs(c, 0, len(c.token_ids), body.top_logprobs or 0) if body.logprobs else None
            content, calls, finish = c.text, None, c.finish_reason
            if body.tool_mode != "none":
                content, calls = self.tool_parser(body).parse(c.text)
                calls = calls or None
                if calls and finish == "stop":
                    finish = "tool_calls"
            extra = {"token_origins": origin_pieces(c, 0, len(c.text))} if body.return_token_origins else {}
            choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=content, tool_calls=calls),
                                      logprobs=lp, finish_reason=finish, stop_reason=c.stop_reason, **extra))
        resp = ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage_of([out]),
                                      spec_decode=spec_of([out]))
        return resp.model_dump()

    async def _events(self, rid: str, model: str, body: ChatCompletionRequest, params: SamplingParams,
                      stream: RequestStream) -> AsyncIterator[str]:
        created = int(time.time())
        choices = {i: StreamedChoice(i) for i in range(body.n)}
        hold = stop_hold(params)
        top_n = body.top_logprobs or 0
        parsers = {i: self.tool_parser(body) for i in range(body.n)} if body.tool_mode != "none" else {}
        called: set[int] = set()

        def chunk(cs: list[ChatStreamChoice], **extra) -> str:
            return chunk_event(ChatCompletionChunk(id=rid, created=created, model=model, choices=cs, **extra))

        for i in range(body.n):
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        final = None
        async for out in stream:
            if out.finished:
                final = out
            cs = []
            for c in out.outputs:
                ch = choices[c.index]
                if ch.done:
                    continue
                start = ch.text
                delta, ntok = ch.delta(c, hold)
                finished = c.finish_reason is not None
                if not delta and not finished and (not body.logprobs or ntok == ch.tokens):
                    continue
                lp = self._logprobs(c, ch.tokens, ntok, top_n) if body.logprobs else None
                ch.tokens = ntok
                ch.done = finished
                calls = None
                if c.index in parsers:  # tool calls leave the content and go out as tool_calls deltas
                    delta, calls = parsers[c.index].stream(delta, finished)
                    if calls:
                        called.add(c.index)
                    elif not delta and not finished and lp is None:
                        continue  # held back: it may be the start of a call
                finish = c.finish_reason if finished else None
                if finish == "stop" and c.index in called:
                    finish = "tool_calls"
                extra = {"token_origins": origin_pieces(c, start, ch.text)} if body.return_token_origins else {}
                cs.append(ChatStreamChoice(index=ch.index,
                                           delta=DeltaMessage(content=delta or None, tool_calls=calls or None),
                                           logprobs=lp, finish_reason=finish,
                                           stop_reason=c.stop_reason if finished else None, **extra))
            if cs:
                yield chunk(cs)
        # usage (and the spec-decode summary) goes in a chunk of its own, only when asked for (OpenAI, vLLM)
        if body.include_usage and final is not None:
            yield chunk([], usage=usage_of([final]), spec_decode=spec_of([final]))


class UnlessRepeated:
    """One reply's stream, answered again with tools off when it turns out to repeat a call just answered.

    Small models that write bare JSON calls (json_calls.py) often call the same tool again after its result,
    so an agent's tool loop never ends; with the tools left out of the prompt they answer from the result. The
    rule only takes a bare JSON reply identical (name and arguments) to a call of the last assistant message
    whose results follow it: a model using its tool-call tags, or calling anything else, is passed through. The
    reply is held while it could still become a call (the chat parser holds it then anyway), so nothing of it
    has been sent when the second request (``again()``) starts. Same sampling parameters: as exact as any
    request."""

    def __init__(self, first: RequestStream, tools: list[dict[str, Any]], answered: list[tuple[str, Any]],
                 again: Callable[[], Awaitable[RequestStream]]):
        self._streams = [first]
        self.request_id = first.request_id
        self._tools = tool_schemas(tools)
        self._answered, self._again = answered, again

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        deciding = True
        async for out in self._streams[0]:
            text = out.outputs[0].text
            if deciding and not out.finished and could_become_call(text, self._tools):
                continue  # outputs are cumulative: the next one carries this one's text
            if deciding and out.finished and repeats_answered_call(text, self._tools, self._answered):
                self._streams.append(await self._again())
                async for again in self._streams[1]:
                    yield again
                return
            deciding = False
            yield out

    def close(self) -> None:
        for s in self._streams:
            s.close()


def origin_pieces(c: CompletionOutput, start: int, end: int) -> list[dict[str, str]]:
    """``c.text[start:end]`` cut where its tokens' texts end, each piece with its token's origin (the
    ``return_token_origins`` extension): [{"text": ..., "origin": ...}, ...]."""
    ends, pieces = c.token_text_ends, []
    i = bisect.bisect_right(ends, start)  # the first token whose text reaches past start
    while start < end and i < len(ends):
        stop = min(ends[i], end)
        if stop > start:
            pieces.append({"text": c.text[start:stop], "origin": c.token_origins[i]})
            start = stop
        i += 1
    return pieces


async def reply_deltas(stream: RequestStream, params: SamplingParams, parser: ToolParser | None
                       ) -> AsyncIterator[tuple[str, list[dict[str, Any]], RequestOutput]]:
    """One reply (n=1) as it streams, one item per engine output: (text to send now, tool calls completed now,
    the output). Text that could still become a stop string or the start of a tool call is held back until it
    cannot."""
    sent = StreamedChoice(0)
    hold = stop_hold(params)
    async for out in stream:
        c = out.outputs[0]
        delta, _ = sent.delta(c, hold)
        calls: list[dict[str, Any]] = []
        if parser is not None:
            delta, calls = parser.stream(delta, c.finish_reason is not None)
        yield delta, calls, out


def register(app: FastAPI, **serving_args: Any) -> None:
    serving = OpenAIServingChat(**serving_args)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.create_chat_completion(body, request)
