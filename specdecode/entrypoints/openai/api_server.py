"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, vLLM's /tokenize and
/detokenize, /health, /metrics.

One AsyncLLMEngine (one engine thread doing continuous batching) serves every request. Run it with
``specdecode serve [MODEL] ...`` or its older vLLM spelling ``python -m specdecode.entrypoints.openai.api_server
--model PATH ...`` (the same command, flags and errors).
"""
from __future__ import annotations

if __name__ == "__main__":
    # ``python -m`` runs this file as __main__: parse the command line before the imports below (torch, the
    # web stack), so that --help and a bad flag answer at once. The server itself imports this module again
    # under its own name.
    import sys

    from specdecode.entrypoints.openai.cli_args import module_main
    sys.exit(module_main())

import argparse
import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode import startup
from specdecode.engine.async_engine import (AsyncLLMEngine, EngineDeadError, EngineStepError, RequestFailedError,
                                            RequestStream)
from specdecode.engine.llm_engine import LLMEngine
from specdecode.engine.scheduler import QueueFullError
from specdecode.entrypoints.openai.cli_args import (DEFAULT_BODY_TIMEOUT, DEFAULT_LIMIT_CONCURRENCY,
                                                    DEFAULT_MAX_BODY_BYTES, add_server_args, engine_kwargs_from_args,
                                                    is_out_of_memory, out_of_memory_message)
from specdecode.entrypoints.openai.metrics import ServerMetrics
from specdecode.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                                    ChatCompletionResponse, ChatLogprobs, ChatResponseMessage,
                                                    ChatStreamChoice, CompletionChoice, CompletionChunk,
                                                    CompletionLogprobs, CompletionRequest, CompletionResponse,
                                                    CompletionTokensDetails, DeltaMessage, DetokenizeRequest,
                                                    DetokenizeResponse, ErrorResponse, ModelCard, ModelList, ParamError,
                                                    SpecDecodeSummary, TokenizeChatRequest, TokenizeCompletionRequest,
                                                    TokenizeResponse, TokenLogprob, TopLogprob, UsageInfo)
from specdecode.outputs import CompletionOutput, Logprob, RequestOutput
from specdecode.sampling_params import SamplingParams
from specdecode.speculative.metrics import SpecDecodeStats
from specdecode.structured.tools import get_tool_parser, resolve_tool_parser, xgrammar_message
from specdecode.tokenizer import apply_chat_template, encode_text

logger = logging.getLogger("specdecode.server")

__all__ = ["add_server_args", "run_server", "build_app", "engine_kwargs_from_args"]


# ====================================================================== errors
class APIError(Exception):
    """Becomes ``{"error": {"message", "type", "param", "code"}}`` with the given HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
             500: "server_error", 503: "server_error"}

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


# Seconds a client is told to wait after a 503: a full queue drains within a few engine steps; a server that
# is shutting down needs a restart (or another replica).
RETRY_AFTER_QUEUE_FULL = "1"
RETRY_AFTER_DEAD = "10"


def _from_exception(e: BaseException, prompt_param: str = "prompt") -> APIError:
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


def _field_param(msg: str) -> str | None:
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
    return _field_param(msg)


def _loc_path(loc: tuple) -> str:
    """A pydantic error location as the request's field path: without "body" and without the union member
    tags pydantic puts in it ('str', 'list[ContentPart]', 'NamedToolChoice'), which are not request fields."""
    return ".".join(str(x) for x in loc if x != "body" and not (
        isinstance(x, str) and ("[" in x or x[:1].isupper() or x in ("str", "int", "float", "bool", "dict", "list"))))


def _validation_error(exc: RequestValidationError) -> APIError:
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
            param = param or _field_param(msg)
            parts.append(msg)
            continue
        param = param or (field or None)
        parts.append(f"{field or 'body'}: {msg}")
    return APIError(400, "Invalid request: " + "; ".join(parts), param=param, code="invalid_value")


# ====================================================================== helpers
def _spec_summary(stats: list[SpecDecodeStats]) -> SpecDecodeSummary:
    drafts = sum(s.num_drafts for s in stats)
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    return SpecDecodeSummary(drafts=drafts, drafted=drafted, accepted=accepted,
                             acceptance_rate=round(accepted / drafted, 6) if drafted else 0.0)


def _usage(outs: list[RequestOutput], generated: bool = True) -> UsageInfo:
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(x.token_ids) for o in outs for x in o.outputs) if generated else 0
    usage = UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
    predicted = [o.metrics for o in outs if o.metrics is not None and o.metrics.accepted_prediction_tokens is not None]
    if predicted:
        usage.completion_tokens_details = CompletionTokensDetails(
            accepted_prediction_tokens=sum(m.accepted_prediction_tokens for m in predicted),
            rejected_prediction_tokens=sum(m.rejected_prediction_tokens for m in predicted))
    return usage


def _spec_of(outs: list[RequestOutput]) -> SpecDecodeSummary:
    return _spec_summary([o.metrics.spec_decode for o in outs if o.metrics is not None])


def _extend(lp: CompletionLogprobs, more: CompletionLogprobs) -> None:
    lp.tokens += more.tokens
    lp.token_logprobs += more.token_logprobs
    lp.top_logprobs += more.top_logprobs
    lp.text_offset += more.text_offset


class _Choice:
    """What has been sent of one choice in a stream."""
    __slots__ = ("index", "text", "tokens", "done", "offset")

    def __init__(self, index: int):
        self.index = index
        self.text = 0      # characters of text sent
        self.tokens = 0    # tokens (and logprob entries) sent
        self.done = False
        self.offset = 0    # text_offset of the next completion logprob entry


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several request streams as (stream index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((i, None, e))
        else:
            q.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await q.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
        await asyncio.sleep(0.05)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _chunk_dict(model) -> dict:
    d = model.model_dump(exclude_none=True)
    for c in d.get("choices", []):
        c.setdefault("logprobs", None)
        c.setdefault("finish_reason", None)
    return d


class _ClientGone(Exception):
    pass


# ====================================================================== server state
# chat_template_kwargs go to the model's template as its variables (Qwen3's enable_thinking, RAG templates'
# documents). These keys are not variables: they would replace what the request's own fields say, run a template
# the client wrote (a Jinja template can take the server's memory and time), or ask for tokenizer outputs.
_TEMPLATE_KWARGS_REFUSED = {
    **{k: "use the request's own field." for k in ("messages", "conversation", "tools", "add_generation_prompt",
                                                   "continue_final_message")},
    "chat_template": "the server renders the model's own chat template; a request cannot bring its own.",
    **{k: "the server tokenizes the rendered prompt itself." for k in (
        "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask", "padding", "truncation",
        "max_length", "tokenizer_kwargs")},
}


class OpenAIServer:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], api_key: str | None,
                 metrics: ServerMetrics, model_path: str | None = None, tool_call_parser: str = "auto"):
        self.engine = engine
        self.names = served_model_names
        self.api_key = api_key
        self.metrics = metrics
        self.model_path = model_path
        self.tokenizer = engine.tokenizer
        self.accepted_models = set(served_model_names) | ({model_path} if model_path else set())
        self.token_str = engine.token_text  # one token's text, cached by the engine (Logprob.decoded_token)
        # How tool calls are read from output and enforced (vLLM's --tool-call-parser), by registered name.
        self.tool_call_parser = resolve_tool_parser(tool_call_parser).name

    # ---- request checks ----
    def check_model(self, name: str | None) -> str:
        if name is None or name in self.accepted_models:
            return self.names[0]
        raise APIError(404, f"The model `{name}` does not exist. This server serves {self.names}.",
                       param="model", code="model_not_found")

    def check_vocab(self, params: SamplingParams) -> None:
        """logit_bias, stop_token_ids and allowed_token_ids name token ids of this model's vocabulary; otherwise a
        400 naming the field (a stop token the model cannot produce would be ignored without a word)."""
        engine = getattr(self.engine, "engine", None)
        if engine is None:
            return
        vocab = engine.target.vocab_size
        for field, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids),
                           ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = sorted(t for t in ids if t >= vocab)
            if outside:
                raise APIError(400, f"{field} names token id {outside[0]}, outside this model's vocabulary (ids "
                                    f"0..{vocab - 1}).", param=field, code="invalid_value")

    async def compile_constraint(self, params: SamplingParams, param: str | None) -> None:
        """Compile a request's output constraint (JSON schema, regex, grammar) in a worker thread, so that
        neither the event loop nor the engine thread waits for it; the engine then finds it compiled. A
        constraint that does not compile is a 400 carrying xgrammar's message and naming ``param``, the
        request field the constraint came from."""
        engine = getattr(self.engine, "engine", None)
        if params.structured_outputs is None or engine is None:
            return
        try:
            await run_in_threadpool(engine.grammar_compiler.compile, params.structured_outputs)
        except ValueError as e:
            raise APIError(400, xgrammar_message(str(e)), param=param, code="invalid_value") from None

    # ---- running requests ----
    async def start(self, base_id: str, prompts: list[tuple[str | None, list[int] | None]],
                    params: SamplingParams, prompt_param: str, suffix: str | None = None) -> list[RequestStream]:
        scheduler = getattr(getattr(self.engine, "engine", None), "scheduler", None)
        total = len(prompts) * params.n
        if len(prompts) > 1 and scheduler is not None and total > max(scheduler.max_waiting, 1):
            # Together they could be queued only while enough slots happen to be free: refuse for good, not 503.
            raise APIError(400, f"{len(prompts)} prompts x n={params.n} make {total} sequences, more than the waiting "
                                f"limit of {scheduler.max_waiting}, so this request could not be queued while the "
                                "server is busy; send fewer prompts per request or lower n.", param=prompt_param,
                           code="invalid_value")
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.engine.add_request(rid, text, params, prompt_token_ids=ids, suffix=suffix))
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, Exception):
                raise _from_exception(e, prompt_param) from None
            raise
        return streams

    async def collect(self, streams: list[RequestStream], request: Request) -> list[RequestOutput]:
        """Final outputs of all streams; aborts them all if the client disconnects first."""
        async def last(s: RequestStream) -> RequestOutput:
            out = None
            async for out in s:
                pass
            return out

        work = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
        work.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "exception not retrieved"
        watch = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            work.cancel()
            raise _ClientGone()
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
            for s in streams:
                s.close()

    # ---- logprobs ----
    def completion_logprobs(self, c: CompletionOutput, start: int, end: int, offset: int) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for t, d in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            offset = self._add_completion_logprobs(lp, t, d, offset)
        return lp

    def _add_completion_logprobs(self, lp: CompletionLogprobs, token: int, d: dict[int, Logprob] | None,
                                 offset: int) -> int:
        """One position of a completions ``logprobs`` object (d None: a prompt's first token, which has no
        logprob); returns the next position's text offset."""
        s = self.token_str(token)
        lp.tokens.append(s)
        lp.token_logprobs.append(d[token].logprob if d else None)
        top: dict[str, float] | None = None
        if d:
            top = {}
            for k, v in sorted(d.items(), key=lambda kv: -kv[1].logprob):
                top.setdefault(self.token_str(k), v.logprob)
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        return offset + len(s)

    def prompt_logprobs(self, out: RequestOutput) -> CompletionLogprobs:
        """The prompt's tokens as a completions ``logprobs`` object (echo with logprobs); the first has none."""
        lp = CompletionLogprobs()
        offset = 0
        for t, d in zip(out.prompt_token_ids, out.prompt_logprobs or []):
            offset = self._add_completion_logprobs(lp, t, d, offset)
        return lp

    def chat_logprobs(self, c: CompletionOutput, start: int, end: int, top_n: int) -> ChatLogprobs:
        content = []
        for t, d in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            s = self.token_str(t)
            tops = [TopLogprob(token=self.token_str(k), logprob=v.logprob, bytes=list(self.token_str(k).encode()))
                    for k, v in sorted(d.items(), key=lambda kv: -kv[1].logprob)[:top_n]]
            content.append(TokenLogprob(token=s, logprob=d[t].logprob, bytes=list(s.encode()), top_logprobs=tops))
        return ChatLogprobs(content=content)

    # ---- completions ----
    def completion_response(self, rid: str, model: str, body: CompletionRequest, echoes: list[str],
                            outs: list[RequestOutput]) -> dict:
        choices = []
        n = body.n
        for p, out in enumerate(outs):
            for c in out.outputs:
                prefix = echoes[p] if body.echo else ""
                lp = None
                if body.logprobs is not None:
                    lp = self.prompt_logprobs(out) if body.echo else CompletionLogprobs()
                    if not body.echo_only:
                        _extend(lp, self.completion_logprobs(c, 0, len(c.token_ids), len(prefix)))
                if body.echo_only:  # the one token generated to get there is not part of the answer
                    choices.append(CompletionChoice(index=p * n + c.index, text=prefix, logprobs=lp,
                                                    finish_reason="length"))
                    continue
                choices.append(CompletionChoice(index=p * n + c.index, text=prefix + c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        resp = CompletionResponse(id=rid, model=model, choices=choices, usage=_usage(outs, not body.echo_only),
                                  spec_decode=_spec_of(outs))
        return resp.model_dump()

    async def stream_completion(self, rid: str, model: str, body: CompletionRequest, params: SamplingParams,
                                echoes: list[str], streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        n = body.n
        choices = {(p, i): _Choice(p * n + i) for p in range(len(streams)) for i in range(n)}
        hold = max((len(s) for s in params.stop), default=1) - 1
        finals: dict[int, RequestOutput] = {}

        def chunk(cs: list[CompletionChoice], **extra) -> str:
            return _sse(_chunk_dict(CompletionChunk(id=rid, created=created, model=model, choices=cs, **extra)))

        # echo: the prompt first; with logprobs, once they are computed (with the first output of its prompt)
        echoed = set() if body.echo and params.prompt_logprobs is not None else set(range(len(streams)))
        try:
            if body.echo and echoed:
                yield chunk([CompletionChoice(index=ch.index, text=echoes[p]) for (p, _), ch in choices.items()])
            async for p, out in _merge(streams):
                if out.finished:
                    finals[p] = out
                if p not in echoed and out.prompt_logprobs is not None:
                    echoed.add(p)
                    lp = self.prompt_logprobs(out)
                    for i in range(n):
                        choices[(p, i)].offset = len(echoes[p])
                    yield chunk([CompletionChoice(index=choices[(p, i)].index, text=echoes[p], logprobs=lp)
                                 for i in range(n)])
                if body.echo_only:  # nothing generated is sent: each choice just ends
                    if out.finished:
                        yield chunk([CompletionChoice(index=choices[(p, c.index)].index, text="",
                                                      finish_reason="length") for c in out.outputs])
                    continue
                cs = []
                for c in out.outputs:
                    ch = choices[(p, c.index)]
                    if ch.done:
                        continue
                    delta, ntok = self._delta(ch, c, hold)
                    finished = c.finish_reason is not None
                    if not delta and not finished and (body.logprobs is None or ntok == ch.tokens):
                        continue
                    lp = None
                    if body.logprobs is not None:
                        lp = self.completion_logprobs(c, ch.tokens, ntok, ch.offset)
                        ch.offset += sum(len(s) for s in lp.tokens)
                    ch.tokens = ntok
                    ch.done = finished
                    cs.append(CompletionChoice(index=ch.index, text=delta, logprobs=lp,
                                               finish_reason=c.finish_reason if finished else None,
                                               stop_reason=c.stop_reason if finished else None))
                if cs:
                    yield chunk(cs)
            # usage (and the spec-decode summary) goes in a chunk of its own, only when asked for (OpenAI, vLLM)
            if body.include_usage:
                all_outs = [finals[i] for i in range(len(streams))]
                yield chunk([], usage=_usage(all_outs, not body.echo_only), spec_decode=_spec_of(all_outs))
        except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
            err = _from_exception(e)
            self.metrics.on_http_error(err.status)
            yield _sse(err.body())
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"

    @staticmethod
    def _delta(ch: _Choice, c: CompletionOutput, hold: int) -> tuple[str, int]:
        """New text to send (holding back what could still turn into a stop string) and the token count."""
        text = c.text
        end = len(text) if c.finish_reason is not None else max(ch.text, len(text) - hold)
        delta = text[ch.text:end]
        ch.text = max(ch.text, end)
        return delta, len(c.token_ids)

    def token_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """/tokenize: with the special tokens, the ids a request with this text feeds the model."""
        if add_special_tokens:
            return encode_text(self.tokenizer, text)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- chat ----
    def chat_prompt(self, body: ChatCompletionRequest) -> str:
        try:
            messages = [m.as_template_dict(f"messages.{i}") for i, m in enumerate(body.messages)]
            kwargs = dict(body.chat_template_kwargs or {})
            for key in kwargs:
                why = _TEMPLATE_KWARGS_REFUSED.get(key)
                if why is not None:
                    raise ParamError(f"chat_template_kwargs.{key}", f"chat_template_kwargs may not set {key!r}: {why}")
            return apply_chat_template(self.tokenizer, messages, body.add_generation_prompt, tools=body.tool_dicts(),
                                       continue_final_message=body.continue_final_message, **kwargs)
        except ValueError as e:
            # the field the message starts with (apply_chat_template's continue_final_message errors), else messages
            param = getattr(e, "param", None) or _field_param(str(e)) or "messages"
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        except Exception as e:  # jinja errors from a template that rejects the conversation
            raise APIError(400, f"The chat template could not render these messages: {e}", param="messages",
                           code="invalid_value") from None

    def chat_response(self, rid: str, model: str, body: ChatCompletionRequest, out: RequestOutput) -> dict:
        choices = []
        for c in out.outputs:
            lp = self.chat_logprobs(c, 0, len(c.token_ids), body.top_logprobs or 0) if body.logprobs else None
            content, calls, finish = c.text, None, c.finish_reason
            if body.tool_mode != "none":
                content, calls = get_tool_parser(self.tool_call_parser, body.max_tool_calls).parse(c.text)
                calls = calls or None
                if calls and finish == "stop":
                    finish = "tool_calls"
            choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=content, tool_calls=calls),
                                      logprobs=lp, finish_reason=finish, stop_reason=c.stop_reason))
        resp = ChatCompletionResponse(id=rid, model=model, choices=choices, usage=_usage([out]),
                                      spec_decode=_spec_of([out]))
        return resp.model_dump()

    async def stream_chat(self, rid: str, model: str, body: ChatCompletionRequest, params: SamplingParams,
                          stream: RequestStream) -> AsyncIterator[str]:
        created = int(time.time())
        choices = {i: _Choice(i) for i in range(body.n)}
        hold = max((len(s) for s in params.stop), default=1) - 1
        top_n = body.top_logprobs or 0
        parsers = {i: get_tool_parser(self.tool_call_parser, body.max_tool_calls) for i in range(body.n)} \
            if body.tool_mode != "none" else {}
        called: set[int] = set()

        def chunk(cs: list[ChatStreamChoice], **extra) -> str:
            return _sse(_chunk_dict(ChatCompletionChunk(id=rid, created=created, model=model, choices=cs,
                                                        **extra)))

        try:
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
                    delta, ntok = self._delta(ch, c, hold)
                    finished = c.finish_reason is not None
                    if not delta and not finished and (not body.logprobs or ntok == ch.tokens):
                        continue
                    lp = self.chat_logprobs(c, ch.tokens, ntok, top_n) if body.logprobs else None
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
                    cs.append(ChatStreamChoice(index=ch.index,
                                               delta=DeltaMessage(content=delta or None, tool_calls=calls or None),
                                               logprobs=lp, finish_reason=finish,
                                               stop_reason=c.stop_reason if finished else None))
                if cs:
                    yield chunk(cs)
            # usage (and the spec-decode summary) goes in a chunk of its own, only when asked for (OpenAI, vLLM)
            if body.include_usage and final is not None:
                yield chunk([], usage=_usage([final]), spec_decode=_spec_of([final]))
        except Exception as e:  # noqa: BLE001
            err = _from_exception(e)
            self.metrics.on_http_error(err.status)
            yield _sse(err.body())
        finally:
            stream.close()
        yield "data: [DONE]\n\n"


# ====================================================================== app
_DRAIN_FACTOR, _DRAIN_BYTES = 4, 64 * 1024 * 1024  # how much of an oversized body is read only to be dropped
_JSON_LIKE = (b"", b"application/x-www-form-urlencoded", b"text/plain")
_API_PATHS = ("/v1", "/tokenize", "/detokenize")  # JSON bodies, behind the API key


class _Gate:
    """Plain ASGI middleware in front of every route; checks run before any body is parsed.

    - API key: /v1/* and the OpenAPI schema need ``Authorization: Bearer <key>`` when a key is set (compared in
      constant time); /metrics too with ``metrics_require_key``. /health stays open for load balancers.
    - Body size: over ``max_body_bytes`` is a 413, decided from Content-Length or while reading, so a huge
      body is never held or parsed.
    - Slow clients: a body that stalls for ``body_timeout`` seconds is a 408, not a connection held forever.
    - A POST without a JSON content type (curl -d sends form encoding) is read as JSON, as vLLM does."""

    def __init__(self, app, api_key: str | None, on_reject, max_body_bytes: int, body_timeout: float,
                 metrics_require_key: bool):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.on_reject = on_reject
        self.max_body = max_body_bytes
        self.body_timeout = body_timeout
        self.protected = _API_PATHS + ("/openapi.json",) + (("/metrics",) if metrics_require_key else ())

    async def _reject(self, send, err: APIError) -> None:
        self.on_reject(err.status)
        resp = JSONResponse(err.body(), status_code=err.status, headers={"Connection": "close"})
        await resp({"type": "http"}, None, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if self.expected is not None and path.startswith(self.protected) and scope.get("method") != "OPTIONS":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await self._reject(send, APIError(
                    401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"))
        if scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        too_big = APIError(413, f"The request body is larger than the server's limit of {self.max_body} bytes.",
                           code="request_too_large")
        try:
            declared = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            declared = 0
        if declared > self.max_body and headers.get(b"expect", b"").lower() == b"100-continue":
            return await self._reject(send, too_big)  # the client waits for our word before sending the body
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except asyncio.TimeoutError:
                return await self._reject(send, APIError(
                    408, f"The request body did not arrive within {self.body_timeout:g} s.", code="request_timeout"))
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_body:
                chunks.append(chunk)
            elif chunks:
                chunks = []  # over the limit: what follows is read only to be dropped
            if not message.get("more_body", False) or size > _DRAIN_FACTOR * self.max_body + _DRAIN_BYTES:
                break
        if size > self.max_body:
            # The rest was drained (cheaply, up to a bound) so the client, still sending, reads a 413 instead of
            # a reset connection.
            return await self._reject(send, too_big)
        body = b"".join(chunks)
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices

        ctype = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if path.startswith(_API_PATHS):
            if ctype in _JSON_LIKE:
                scope = dict(scope, headers=[(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
                             + [(b"content-type", b"application/json")])
            elif ctype != b"application/json" and not ctype.endswith(b"+json"):
                return await self._reject(send, APIError(
                    415, f"The request body is sent as {ctype.decode('latin-1')!r}; send it as application/json.",
                    code="unsupported_media_type"))
        await self.app(scope, replay, send)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, with the error responses this server really sends: 400 in OpenAI's error shape for
    an invalid body (FastAPI would document its own 422)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        schemas["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        for defs_name, defs in schemas["ErrorResponse"].pop("$defs", {}).items():
            schemas.setdefault(defs_name, defs)
        for schemas_name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(schemas_name, None)
        error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for item in schema.get("paths", {}).values():
            for op in item.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = dict(error, description="Invalid request")
        app.openapi_schema = schema
    return app.openapi_schema


async def _json_object(request: Request) -> dict:
    """A route's body read by hand: a JSON object, or the 400 FastAPI's own parsing would give."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"The request body is not valid JSON ({e}).", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(data).__name__}.",
                       code="invalid_value")
    return data


def _validated(model: type[BaseModel], data: dict) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(RequestValidationError(e.errors())) from None


def _normalise_prompts(prompt: Any) -> list[tuple[str | None, list[int] | None]]:
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise APIError(400, "prompt must not be empty.", param="prompt", code="invalid_value")
    if all(isinstance(x, int) for x in prompt):
        return [(None, list(prompt))]
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((p, None))
        elif isinstance(p, list) and p:
            out.append((None, list(p)))
        else:
            raise APIError(400, "prompt entries must be strings or non-empty lists of token ids.", param="prompt",
                           code="invalid_value")
    return out


def build_app(engine_kwargs: dict | None = None, served_model_name: str | list[str] | None = None,
              api_key: str | None = None, *, engine: AsyncLLMEngine | LLMEngine | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout: float = DEFAULT_BODY_TIMEOUT,
              metrics_require_key: bool = False, tool_call_parser: str = "auto") -> FastAPI:
    """The FastAPI app. Loads the engine now (ValueError for bad settings) unless one is passed in.

    ``metrics_require_key``: /metrics is open by default, as in vLLM (scrapers rarely send keys); set it to
    put /metrics behind the API key too."""
    resolve_tool_parser(tool_call_parser)  # an unknown name fails before the models load
    if engine is None:
        engine = AsyncLLMEngine.from_kwargs(**(engine_kwargs or {}))
    elif isinstance(engine, LLMEngine):
        engine = AsyncLLMEngine(engine)
    kw = engine_kwargs or {}
    model_path = kw.get("model") or str(getattr(engine.engine, "model_path", "") or "") or None
    if isinstance(served_model_name, str):
        names = [served_model_name]
    elif served_model_name:
        names = list(served_model_name)
    else:
        default_path = getattr(engine.engine, "model_path", None)
        names = [kw.get("model") or (os.path.basename(str(default_path)) if default_path else "specdecode")]
    metrics = ServerMetrics(names[0])
    engine.step_callback = metrics.on_step
    engine.error_callback = metrics.on_engine_error
    srv = OpenAIServer(engine, names, api_key, metrics, model_path, tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="specdecode OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = srv
    app.state.engine = engine
    app.add_middleware(_Gate, api_key=api_key, on_reject=metrics.on_http_error, max_body_bytes=max_body_bytes,
                       body_timeout=body_timeout, metrics_require_key=metrics_require_key)
    app.openapi = functools.partial(_openapi, app)

    def error_response(err: APIError) -> JSONResponse:
        metrics.on_http_error(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        # FastAPI raises a 400 itself only for a body it could not decode (bad UTF-8, a number too long to read)
        code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(exc.status_code, str(exc.detail), code=code))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        return error_response(_from_exception(exc))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(APIError(503, "The engine loop is not running.", code="engine_unavailable"))
        return Response(status_code=200)

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)  # load balancers probe with it

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [ModelCard(id=name, root=model_path, max_model_len=engine.max_model_len) for name in names]
        return ModelList(data=cards).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        # OpenAI's "retrieve model": the card of a served name (or of the model path a request may name)
        name = model_id if model_id in names else srv.check_model(model_id)
        return ModelCard(id=name, root=model_path, max_model_len=engine.max_model_len).model_dump()

    def params_of(body) -> SamplingParams:
        try:
            if isinstance(body, ChatCompletionRequest):
                return body.to_sampling_params(srv.tool_call_parser)
            return body.to_sampling_params()
        except ParamError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        except ValueError as e:  # SamplingParams' checks start with the field's name
            msg = str(e).replace("Invalid SamplingParams: ", "")
            raise APIError(400, msg, param=_field_param(msg), code="invalid_value") from None

    # vLLM's tokenizer endpoints. The body is a completion's prompt or a chat's messages, told apart by which
    # field it has, so that an unknown field is named against the one form it was meant for.
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        data = await _json_object(request)
        body = _validated(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, data)
        srv.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = await run_in_threadpool(srv.chat_prompt, body.as_chat_request())
        else:
            text = body.prompt
        ids = await run_in_threadpool(srv.token_ids, text, body.add_special_tokens)
        strs = srv.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                                token_strs=strs).model_dump(exclude_none=True)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        srv.check_model(body.model)
        vocab = len(srv.tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens holds {bad}, outside this tokenizer's ids 0..{vocab - 1}.", param="tokens",
                           code="invalid_value")
        text = await run_in_threadpool(srv.tokenizer.decode, body.tokens)
        return DetokenizeResponse(prompt=text).model_dump()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        model = srv.check_model(body.model)
        params = params_of(body)
        srv.check_vocab(params)
        await srv.compile_constraint(params, body.constraint_param())
        prompts = _normalise_prompts(body.prompt)
        rid = f"cmpl-{uuid.uuid4().hex}"
        # checks the token ids before echo decodes them
        streams = await srv.start(rid, prompts, params, "prompt", suffix=body.suffix)
        echoes = [text if text is not None else srv.tokenizer.decode(ids) for text, ids in prompts] \
            if body.echo else [""] * len(prompts)
        if body.stream:
            return StreamingResponse(srv.stream_completion(rid, model, body, params, echoes, streams),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            outs = await srv.collect(streams, request)
        except _ClientGone:
            return Response(status_code=499)
        except Exception as e:
            raise _from_exception(e) from None
        return JSONResponse(srv.completion_response(rid, model, body, echoes, outs))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        model = srv.check_model(body.model)
        params = params_of(body)
        srv.check_vocab(params)
        await srv.compile_constraint(params, body.constraint_param())
        prompt = await run_in_threadpool(srv.chat_prompt, body)  # templating is CPU work: off the event loop
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        (stream,) = await srv.start(rid, [(prompt, None)], params, "messages")
        if body.stream:
            return StreamingResponse(srv.stream_chat(rid, model, body, params, stream),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            (out,) = await srv.collect([stream], request)
        except _ClientGone:
            return Response(status_code=499)
        except Exception as e:
            raise _from_exception(e) from None
        return JSONResponse(srv.chat_response(rid, model, body, out))

    return app


# ====================================================================== command line
def _fail(msg: str) -> None:
    print(f"specdecode serve: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        _fail(f"cannot listen on {host}:{port}: {e.strerror or e}.")
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, but streams still running when the graceful-shutdown period is about to run out get
    an error event and ``[DONE]`` (a non-streaming request, a 503) instead of being cut mid-response."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, grace: float):
        super().__init__(config)
        self.engine = engine
        self.grace = grace

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        last_word = loop.call_later(max(0.0, self.grace - 1.0), self.engine.fail_in_flight,
                                    "The server is shutting down; the request was not completed.")
        try:
            await super().shutdown(sockets)
        finally:
            last_word.cancel()


def run_server(args: argparse.Namespace, model: str | None, engine: AsyncLLMEngine | None = None) -> None:
    """Loads the engine (or waits for ``engine``, started from the same arguments), then serves until
    SIGINT/SIGTERM. Bad settings: one line on stderr, exit code 2."""
    host, port = getattr(args, "host", None) or "127.0.0.1", getattr(args, "port", None)
    port = 8000 if port is None else port
    if not (0 <= port <= 65535):
        _fail(f"--port must be in 0..65535, got {port}.")
    api_key = getattr(args, "api_key", None) or os.environ.get("SPECDECODE_API_KEY") or None
    kw: dict[str, Any] = {}
    try:
        kw = engine_kwargs_from_args(args, model)
        if engine is not None:
            engine.wait_built()
        app = build_app(kw, getattr(args, "served_model_name", None), api_key, engine=engine,
                        max_body_bytes=getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_BODY_BYTES,
                        body_timeout=getattr(args, "request_body_timeout", None) or DEFAULT_BODY_TIMEOUT,
                        metrics_require_key=bool(getattr(args, "metrics_require_key", False)),
                        tool_call_parser=getattr(args, "server.tool_call_parser", None) or "auto")
    except (ValueError, OSError, RuntimeError) as e:
        if is_out_of_memory(e):  # the KV cache, allocated at load, sized by the flags
            _fail(out_of_memory_message(kw))
        if isinstance(e, RuntimeError):
            raise
        _fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    except KeyboardInterrupt:
        sys.exit(130)
    sock = _bind(host, port)
    grace = getattr(args, "timeout_graceful_shutdown", None)
    grace = 30.0 if grace is None else grace
    # asyncio's own event loop and no WebSocket protocol: uvloop and the websockets package would be imported
    # at every start, after the engine is ready, for streams whose pace the engine sets, not the loop.
    config = uvicorn.Config(app, log_level=getattr(args, "uvicorn_log_level", None) or "warning",
                            loop="asyncio", ws="none",
                            timeout_graceful_shutdown=grace, lifespan="on", timeout_keep_alive=5,
                            limit_concurrency=getattr(args, "limit_concurrency", None) or DEFAULT_LIMIT_CONCURRENCY)
    server = _Server(config, app.state.engine, grace)
    host, port = sock.getsockname()[:2]
    print(f"specdecode: serving {app.state.server.names[0]} on http://{host}:{port} "
          f"(OpenAI API under /v1; Ctrl+C to stop)", file=sys.stderr, flush=True)
    if threading.current_thread() is threading.main_thread():
        # uvicorn handles SIGINT/SIGTERM itself (stop accepting, let in-flight requests finish, lifespan
        # shutdown stops the engine) and then re-raises the signal to the previous handler: make that a
        # clean exit instead of a death by signal.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        app.state.engine.shutdown()
        with contextlib.suppress(OSError):
            sock.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m specdecode.entrypoints.openai.api_server``: see cli_args.module_main."""
    from specdecode.entrypoints.openai.cli_args import module_main
    sys.exit(module_main(argv))
