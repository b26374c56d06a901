"""``/v1/completions``: prompts (text or token ids, one or a batch) in, completions out, whole or streamed;
with echo and logprobs, the prompt's own tokens scored too."""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from specdecode.engine.async_engine import RequestStream
from specdecode.entrypoints.openai.errors import APIError
from specdecode.entrypoints.openai.protocol import CompletionRequest
from specdecode.entrypoints.openai.response_models import (CompletionChoice, CompletionChunk, CompletionLogprobs,
                                                           CompletionResponse)
from specdecode.entrypoints.openai.serving_engine import (OpenAIServing, Prompts, StreamedChoice, chunk_event,
                                                          merge_streams, spec_of, stop_hold, usage_of)
from specdecode.outputs import CompletionOutput, Logprob, RequestOutput
from specdecode.sampling_params import SamplingParams


def _normalise_prompts(prompt: Any) -> Prompts:
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


def _extend(lp: CompletionLogprobs, more: CompletionLogprobs) -> None:
    lp.tokens += more.tokens
    lp.token_logprobs += more.token_logprobs
    lp.top_logprobs += more.top_logprobs
    lp.text_offset += more.text_offset


class OpenAIServingCompletion(OpenAIServing):
    """The completions route: its prompts, its echo, its response and stream."""

    async def create_completion(self, body: CompletionRequest, request: Request) -> Response:
        model, params = await self.prepare(body)
        prompts = _normalise_prompts(body.prompt)
        rid = f"cmpl-{uuid.uuid4().hex}"
        # checks the token ids before echo decodes them
        # a max_tokens the client set must fit; the default (16) is clamped to what the prompt leaves
        explicit = "max_tokens" in body.model_fields_set and body.max_tokens is not None and not body.echo_only
        streams = await self.start(rid, prompts, params, "prompt", suffix=body.suffix,
                                   max_tokens_param="max_tokens" if explicit else None)
        echoes = [text if text is not None else self.tokenizer.decode(ids) for text, ids in prompts] \
            if body.echo else [""] * len(prompts)
        return await self.respond(request, streams, body.stream,
                                  lambda: self._events(rid, model, body, params, echoes, streams),
                                  lambda outs: self._response(rid, model, body, echoes, outs))

    # ---- logprobs ----
    def _logprobs(self, c: CompletionOutput, start: int, end: int, offset: int) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for t, d in zip(c.token_ids[start:end], (c.logprobs or [])[start:end]):
            offset = self._add_logprobs(lp, t, d, offset)
        return lp

    def _add_logprobs(self, lp: CompletionLogprobs, token: int, d: dict[int, Logprob] | None, offset: int) -> int:
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

    def _prompt_logprobs(self, out: RequestOutput) -> CompletionLogprobs:
        """The prompt's tokens as a completions ``logprobs`` object (echo with logprobs); the first has none."""
        lp = CompletionLogprobs()
        offset = 0
        for t, d in zip(out.prompt_token_ids, out.prompt_logprobs or []):
            offset = self._add_logprobs(lp, t, d, offset)
        return lp

    # ---- the response, whole or streamed ----
    def _response(self, rid: str, model: str, body: CompletionRequest, echoes: list[str],
                  outs: list[RequestOutput]) -> dict:
        choices = []
        n = body.n
        for p, out in enumerate(outs):
            for c in out.outputs:
                prefix = echoes[p] if body.echo else ""
                lp = None
                if body.logprobs is not None:
                    lp = self._prompt_logprobs(out) if body.echo else CompletionLogprobs()
                    if not body.echo_only:
                        _extend(lp, self._logprobs(c, 0, len(c.token_ids), len(prefix)))
                if body.echo_only:  # the one token generated to get there is not part of the answer
                    choices.append(CompletionChoice(index=p * n + c.index, text=prefix, logprobs=lp,
                                                    finish_reason="length"))
                    continue
                choices.append(CompletionChoice(index=p * n + c.index, text=prefix + c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        resp = CompletionResponse(id=rid, model=model, choices=choices, usage=usage_of(outs, not body.echo_only),
                                  spec_decode=spec_of(outs))
        return resp.model_dump()

    async def _events(self, rid: str, model: str, body: CompletionRequest, params: SamplingParams,
                      echoes: list[str], streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        n = body.n
        choices = {(p, i): StreamedChoice(p * n + i) for p in range(len(streams)) for i in range(n)}
        hold = stop_hold(params)
        finals: dict[int, RequestOutput] = {}

        def chunk(cs: list[CompletionChoice], **extra) -> str:
            return chunk_event(CompletionChunk(id=rid, created=created, model=model, choices=cs, **extra))

        # echo: the prompt first; with logprobs, once they are computed (with the first output of its prompt)
        echoed = set() if body.echo and params.prompt_logprobs is not None else set(range(len(streams)))
        if body.echo and echoed:
            yield chunk([CompletionChoice(index=ch.index, text=echoes[p]) for (p, _), ch in choices.items()])
        async for p, out in merge_streams(streams):
            if out.finished:
                finals[p] = out
            if p not in echoed and out.prompt_logprobs is not None:
                echoed.add(p)
                lp = self._prompt_logprobs(out)
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
                delta, ntok = ch.delta(c, hold)
                finished = c.finish_reason is not None
                if not delta and not finished and (body.logprobs is None or ntok == ch.tokens):
                    continue
                lp = None
                if body.logprobs is not None:
                    lp = self._logprobs(c, ch.tokens, ntok, ch.offset)
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
            yield chunk([], usage=usage_of(all_outs, not body.echo_only), spec_decode=spec_of(all_outs))


def register(app: FastAPI, **serving_args: Any) -> None:
    serving = OpenAIServingCompletion(**serving_args)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.create_completion(body, request)
