"""vLLM's tokenizer endpoints: ``/tokenize`` (a completion's prompt or a chat's messages to the token ids a
request with them feeds the model) and ``/detokenize``."""
from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from specdecode.entrypoints.openai.errors import APIError, validation_error
from specdecode.entrypoints.openai.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from specdecode.entrypoints.openai.response_models import DetokenizeResponse, TokenizeResponse
from specdecode.entrypoints.openai.serving_engine import OpenAIServing
from specdecode.tokenizer import encode_text


async def _json_object(request: Request) -> dict:
    """A route's body read by hand: a JSON object, or the 400 FastAPI's own parsing would give."""
    try:
        data = await request.json()  # read_json, through the app's JsonRoute
    except json.JSONDecodeError as e:
        raise APIError(400, f"The request body is not valid JSON ({e.msg}).", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(data).__name__}.",
                       code="invalid_value")
    return data


def _validated(model: type[BaseModel], data: dict) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(RequestValidationError(e.errors())) from None


class OpenAIServingTokenization(OpenAIServing):
    """/tokenize and /detokenize with the served model's tokenizer."""

    def token_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """With the special tokens, the ids a request with this text feeds the model."""
        if add_special_tokens:
            return encode_text(self.tokenizer, text)
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def tokenize(self, request: Request) -> dict:
        # The body is a completion's prompt or a chat's messages, told apart by which field it has, so that an
        # unknown field is named against the one form it was meant for.
        data = await _json_object(request)
        body = _validated(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, data)
        self.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = await run_in_threadpool(self.chat_prompt, body.as_chat_request())
        else:
            text = body.prompt
        ids = await run_in_threadpool(self.token_ids, text, body.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids,
                                token_strs=strs).model_dump(exclude_none=True)

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        vocab = len(self.tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens holds {bad}, outside this tokenizer's ids 0..{vocab - 1}.", param="tokens",
                           code="invalid_value")
        text = await run_in_threadpool(self.tokenizer.decode, body.tokens)
        return DetokenizeResponse(prompt=text).model_dump()


def register(app: FastAPI, **serving_args: Any) -> None:
    serving = OpenAIServingTokenization(**serving_args)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return await serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        return await serving.detokenize(body)
