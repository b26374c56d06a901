"""What every generating route shares, written once: the opening steps of a request (the model it names, its
sampling parameters, their token ids, its output constraint, admission to the engine) and the closing ones (a
JSON body, or a stream of server-sent events ending in ``[DONE]``, with errors reported in-band; a client that
goes away aborts its requests). Also the rendering of a chat prompt, shared by chat completions and /tokenize.

Each route's module (serving_completion.py, serving_chat.py, ...) subclasses :class:`OpenAIServing` and adds a
``register(app, **serving_args)`` that puts its routes on the app.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from specdecode.engine.async_engine import AsyncLLMEngine, RequestStream
from specdecode.entrypoints.openai.errors import APIError, field_param, from_exception
from specdecode.entrypoints.openai.metrics import ServerMetrics
from specdecode.entrypoints.openai.protocol import ChatCompletionRequest, ParamError
from specdecode.entrypoints.openai.response_models import (CompletionTokensDetails, SpecDecodeSummary,
                                                           UsageInfo)
from specdecode.outputs import CompletionOutput, RequestOutput
from specdecode.sampling_params import SamplingParams
from specdecode.structured.tools import resolve_tool_parser, xgrammar_message
from specdecode.tokenizer import apply_chat_template

Prompts = list[tuple[str | None, list[int] | None]]  # (text, token ids): one of the two per prompt

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


# ====================================================================== responses and streams
def usage_of(outs: list[RequestOutput], generated: bool = True) -> UsageInfo:
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(x.token_ids) for o in outs for x in o.outputs) if generated else 0
    usage = UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
    predicted = [o.metrics for o in outs if o.metrics is not None and o.metrics.accepted_prediction_tokens is not None]
    if predicted:
        usage.completion_tokens_details = CompletionTokensDetails(
            accepted_prediction_tokens=sum(m.accepted_prediction_tokens for m in predicted),
            rejected_prediction_tokens=sum(m.rejected_prediction_tokens for m in predicted))
    return usage


def spec_of(outs: list[RequestOutput]) -> SpecDecodeSummary:
    """The speculative-decoding counters of these requests, summed."""
    stats = [o.metrics.spec_decode for o in outs if o.metrics is not None]
    drafts = sum(s.num_drafts for s in stats)
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    return SpecDecodeSummary(drafts=drafts, drafted=drafted, accepted=accepted,
                             acceptance_rate=round(accepted / drafted, 6) if drafted else 0.0)


class StreamedChoice:
    """What has been sent of one choice in a stream."""
    __slots__ = ("index", "text", "tokens", "done", "offset")

    def __init__(self, index: int):
        self.index = index
        self.text = 0      # characters of text sent
        self.tokens = 0    # tokens (and logprob entries) sent
        self.done = False
        self.offset = 0    # text_offset of the next completion logprob entry

    def delta(self, c: CompletionOutput, hold: int) -> tuple[str, int]:
        """New text to send (holding back the last ``hold`` characters, which could still turn into a stop
        string) and the output's token count."""
        text = c.text
        end = len(text) if c.finish_reason is not None else max(self.text, len(text) - hold)
        delta = text[self.text:end]
        self.text = max(self.text, end)
        return delta, len(c.token_ids)


def stop_hold(params: SamplingParams) -> int:
    """Characters a stream holds back: the longest stop string but one."""
    return max((len(s) for s in params.stop), default=1) - 1


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_sse(err: APIError) -> str:
    return sse(err.body())


def chunk_event(model) -> str:
    """A stream chunk as an event; each choice says ``logprobs`` and ``finish_reason``, null or not."""
    d = model.model_dump(exclude_none=True)
    for c in d.get("choices", []):
        c.setdefault("logprobs", None)
        c.setdefault("finish_reason", None)
    return sse(d)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


class _ClientGone(Exception):
    pass


# ====================================================================== the shared steps
class OpenAIServing:
    """The engine and what a request is checked against (the served model names, its vocabulary, the tool-call
    parser), with the steps every generating route takes."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], metrics: ServerMetrics,
                 model_path: str | None = None, tool_call_parser: str = "auto"):
        self.engine = engine
        self.names = served_model_names
        self.metrics = metrics
        self.model_path = model_path
        self.tokenizer = engine.tokenizer
        self.accepted_models = set(served_model_names) | ({model_path} if model_path else set())
        self.token_str = engine.token_text  # one token's text, cached by the engine (Logprob.decoded_token)
        # How tool calls are read from output and enforced (vLLM's --tool-call-parser), by registered name.
        self.tool_call_parser = resolve_tool_parser(tool_call_parser).name

    # ---- opening: checks, then admission ----
    def check_model(self, name: str | None) -> str:
        if name is None or name in self.accepted_models:
            return self.names[0]
        raise APIError(404, f"The model `{name}` does not exist. This server serves {self.names}.",
                       param="model", code="model_not_found")

    def sampling_params(self, body: Any) -> SamplingParams:
        """The request's SamplingParams (the request model's own conversion)."""
        return body.to_sampling_params()

    def _params_of(self, body: Any) -> SamplingParams:
        try:
            return self.sampling_params(body)
        except ParamError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        except ValueError as e:  # SamplingParams' checks start with the field's name
            msg = str(e).replace("Invalid SamplingParams: ", "")
            raise APIError(400, msg, param=field_param(msg), code="invalid_value") from None

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

    async def prepare(self, body: Any) -> tuple[str, SamplingParams]:
        """The served model name a request answers as, and its checked (and compiled) sampling parameters."""
        model = self.check_model(body.model)
        params = self._params_of(body)
        self.check_vocab(params)
        await self.compile_constraint(params, body.constraint_param())
        return model, params

    async def _fit_max_tokens(self, prompts: Prompts, params: SamplingParams, suffix: str | None,
                              param: str) -> Prompts | None:
        """The prompts as token ids, after checking that ``params.max_tokens`` fits in the context each leaves:
        otherwise a 400 naming ``param`` (as vLLM and OpenAI answer), instead of a silent clamp that has the
        client wait for a reply far longer than it asked for. Tokenizing here moves that work, it does not
        repeat it: the engine takes the ids as given. None: not tokenized (the engine will say what is wrong)."""
        engine = getattr(self.engine, "engine", None)
        if engine is None or params.max_tokens is None:
            return None
        limit = engine.max_model_len
        if params.max_tokens >= limit:  # no prompt leaves that much room: no need to tokenize to say so
            raise APIError(400, f"{param} is too large: {params.max_tokens}. This model's context is {limit} tokens, "
                                "and the prompt takes at least one.", param=param, code="invalid_value")
        if params.truncate_prompt_tokens == -1:
            return None  # the client asked for the prompt to be cut to fit: what it leaves is the engine's to say
        out: Prompts = []
        for text, ids in prompts:
            try:
                ids = await run_in_threadpool(engine.input_processor.encode_prompt, text, ids, suffix,
                                              params.truncate_prompt_tokens)
            except ValueError:
                return None  # the engine reports it, naming the prompt field
            if len(ids) + params.max_tokens > limit:
                raise APIError(400, f"{param} is too large: {params.max_tokens}. This model's context is {limit} "
                                    f"tokens and the prompt takes {len(ids)} ({params.max_tokens} > {limit} - "
                                    f"{len(ids)}).", param=param, code="invalid_value")
            out.append((text, ids))
        return out

    async def start(self, base_id: str, prompts: Prompts, params: SamplingParams, prompt_param: str,
                    suffix: str | None = None, max_tokens_param: str | None = None) -> list[RequestStream]:
        """Adds one engine request per prompt (ids ``base_id``, or ``base_id-i`` for several); an error about
        a prompt names ``prompt_param``, the request field that carries it. ``max_tokens_param``: the field
        the client set max_tokens with, so that a value beyond what the context leaves is a 400 naming it
        (None: the engine clamps it to what is left, for a default or an API that sends large values)."""
        encoded = None if max_tokens_param is None else await self._fit_max_tokens(prompts, params, suffix,
                                                                                    max_tokens_param)
        if encoded is not None:
            prompts, suffix = encoded, None  # the ids are the fill-in-the-middle prompt already
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
                raise from_exception(e, prompt_param) from None
            raise
        return streams

    # ---- closing: the whole response, or a stream of events ----
    async def respond(self, request: Request, streams: list[RequestStream], stream: bool,
                      events: Callable[[], AsyncIterator[str]], build: Callable[[list[RequestOutput]], dict],
                      error_event: Callable[[APIError], str] | None = None, done: str = "data: [DONE]\n\n") -> Response:
        """The route's response: with ``stream``, the events ``events()`` yields; otherwise the JSON body
        ``build`` makes of the final outputs (HTTP 499 when the client went away first). A stream reports an
        error in-band as ``error_event`` makes it (an OpenAI error body by default) and ends with ``done``
        (OpenAI's ``[DONE]``; APIs whose streams end with an event of their own pass "")."""
        if stream:
            return StreamingResponse(self._event_stream(events(), streams, error_event or _error_sse, done),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            outs = await self._collect(streams, request)
        except _ClientGone:
            return Response(status_code=499)
        except Exception as e:
            raise from_exception(e) from None
        return JSONResponse(build(outs))

    async def _event_stream(self, events: AsyncIterator[str], streams: list[RequestStream],
                            error_event: Callable[[APIError], str], done: str) -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as e:  # noqa: BLE001 - reported in-band: the status line is already sent
            err = from_exception(e)
            self.metrics.on_http_error(err.status)
            yield error_event(err)
        finally:
            for s in streams:
                s.close()
        if done:
            yield done

    async def _collect(self, streams: list[RequestStream], request: Request) -> list[RequestOutput]:
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

    # ---- chat prompts (chat completions and /tokenize) ----
    def chat_prompt(self, body: ChatCompletionRequest) -> str:
        """The prompt text the model's chat template makes of a chat request; a 400 naming the field for what
        the template cannot take."""
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
            param = getattr(e, "param", None) or field_param(str(e)) or "messages"
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        except Exception as e:  # jinja errors from a template that rejects the conversation
            raise APIError(400, f"The chat template could not render these messages: {e}", param="messages",
                           code="invalid_value") from None
