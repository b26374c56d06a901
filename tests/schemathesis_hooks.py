"""schemathesis hooks for tests/test_openapi_contract.py (loaded through SCHEMATHESIS_HOOKS).

The OpenAPI document states each field's type and range; a few rules tie fields together, which a JSON schema
cannot state, and the server refuses with a 400 naming the field. For the cases schemathesis generates as valid,
these hooks apply those rules, so that "valid by the document" means "valid by the server" (each rule is in
docs/api.md). They also keep generated requests short (the test has a time budget), and leave the cases
generated as invalid alone."""
from __future__ import annotations

import os
from typing import Any

import schemathesis
from schemathesis.generation import GenerationMode

# Fields that carry a grammar, a regex, a JSON schema or a template the server compiles: random text in them is
# rarely one that compiles, and their errors are tested on their own (tests/test_structured.py, test_tools.py).
_COMPILED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
             "response_format", "tools", "tool_choice", "chat_template_kwargs", "prediction", "text", "suffix",
             "logit_bias", "bad_words", "allowed_token_ids", "stop_token_ids", "previous_response_id")


def _valid(body: dict[str, Any], path: str) -> dict[str, Any]:
    for key in _COMPILED:
        body.pop(key, None)
    if "model" in body:  # the served model, so that the request reaches past the 404 for an unknown one
        body["model"] = os.environ.get("SPECDECODE_TEST_MODEL", body["model"])
    # short answers, few of them: the contract is the same, the run stays within its budget
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(key), int):
            body[key] = max(1, min(body[key], 4)) if path != "/v1/completions" or body[key] else 0
    if isinstance(body.get("n"), int):
        body["n"] = min(body["n"], 2)
    body.pop("min_tokens", None)  # at most max_tokens
    body.pop("best_of", None)  # must equal n
    body.pop("truncate_prompt_tokens", None)  # below the context, and not with echo
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True  # top_logprobs needs logprobs
    if body.get("stream") is not True:
        body.pop("stream_options", None)  # only with stream
    if path == "/v1/completions" and body.get("max_tokens") == 0:
        body["echo"] = True  # max_tokens 0 only scores the prompt, with echo
    if path == "/v1/chat/completions" and body.get("max_completion_tokens") is None:
        body["max_tokens"] = min(body.get("max_tokens") or 4, 4)
    if path == "/v1/responses":
        body["max_output_tokens"] = min(body.get("max_output_tokens") or 4, 4)
    if body.get("continue_final_message"):
        body["continue_final_message"] = False  # it needs a final assistant message and no generation prompt
    # prompts within the test model's context (a longer one is a 400 the document cannot foresee)
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][-4:] or body["messages"]
    for message in body.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            message["content"] = message["content"][:100] or "hi"
        elif isinstance(message, dict) and isinstance(message.get("content"), list):
            message["content"] = message["content"][:4]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        body["prompt"] = prompt[:200]
    elif isinstance(prompt, list):
        body["prompt"] = [p[:64] if isinstance(p, (list, str)) else p for p in prompt[:8]]
    for key in ("input", "instructions", "system"):
        if isinstance(body.get(key), str):
            body[key] = body[key][:200]
        elif isinstance(body.get(key), list):
            body[key] = body[key][-4:]
    messages = body.get("messages")
    if path.startswith("/v1/messages") and isinstance(messages, list) and messages and \
            isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
        messages.append({"role": "user", "content": "hi"})  # a final assistant message is a text-only prefill
    if path.startswith("/v1/messages") and isinstance(messages, list):
        # Anthropic's block placement: tool_use blocks only in assistant turns, tool_result blocks only in user ones
        misplaced = {"user": "tool_use", "assistant": "tool_result"}
        for message in messages:
            if isinstance(message, dict) and isinstance(message.get("content"), list):
                wrong = misplaced.get(message.get("role"))
                kept = [b for b in message["content"] if not (isinstance(b, dict) and b.get("type") == wrong)]
                # and a user turn's tool results come before its text
                kept.sort(key=lambda b: not (isinstance(b, dict) and b.get("type") == "tool_result"))
                message["content"] = kept or "hi"
    for item in body.get("input") if isinstance(body.get("input"), list) else []:
        if isinstance(item, dict) and item.get("type") == "function_call":
            item["arguments"] = "{}"  # a call's arguments are a JSON object, in a string
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            message.pop("tool_calls", None)
            if message.get("content") is None:
                message["content"] = "hi"
    return body


@schemathesis.hook
def map_case(context, case):
    meta = getattr(case, "meta", None)
    if meta is None or meta.generation.mode != GenerationMode.POSITIVE or not isinstance(case.body, dict):
        return case
    case.body = _valid(dict(case.body), case.operation.path)
    return case
