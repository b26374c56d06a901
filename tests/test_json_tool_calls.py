"""Tool calls that small models write as one bare JSON object under tool_choice "auto" (specdecode.structured.
json_calls): the parser on its own, whole and streamed, and the default model through the official openai client."""
from __future__ import annotations

import json

import pytest

from specdecode.entrypoints.openai.protocol import ChatMessage
from specdecode.structured.json_calls import (JsonCallParser, answered_calls, json_call, repeats_answered_call,
                                               schema_problem)
from specdecode.structured.tools import get_tool_parser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": WEATHER}}]
SCHEMAS = {"get_weather": WEATHER}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

CALLS = [CALL, f"```json\n{CALL}\n```", f"\n```\n{CALL}\n```\n", f"  {CALL}  ",
         '{"arguments": {"city": "Paris"}, "name": "get_weather"}',
         '{"name": "get_weather", "parameters": {"city": "Paris"}}']
TEXTS = ['{"name": "John", "age": 30}', '```json\n{"name": "John", "age": 30}\n```',
         f"Sure:\n```json\n{CALL}\n```", f"```json\n{CALL}\n```\nThat is how you would call it.",
         '{"name": "get_weather", "arguments": {"town": "Paris"}}',  # does not fit the schema
         '{"name": "get_weather", "arguments": {"city": 5}}', '{"name": "get_weather"}',
         '{"name": "get_weather", "arguments": {"city": "Paris"}, "id": 1}', f"[{CALL}]",
         '```python\nprint("hi")\n```', "The weather in Paris is sunny.", "", "{", f"{CALL}{CALL}"]


@pytest.mark.parametrize("text", CALLS)
def test_a_reply_that_is_one_call_is_a_call(text):
    call = json_call(text, SCHEMAS)
    assert call is not None and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("text", TEXTS)
def test_anything_else_stays_text(text):
    assert json_call(text, SCHEMAS) is None
    content, calls = JsonCallParser(get_tool_parser("auto"), TOOLS).parse(text)
    assert calls == [] and (content or "") == text


def _streamed(text: str, step: int) -> tuple[str, list[dict], int | None]:
    """(content, calls, index of the first delta that carried content)."""
    parser = JsonCallParser(get_tool_parser("auto"), TOOLS)
    outs = [parser.stream(text[i:i + step], False) for i in range(0, len(text), step)] + [parser.stream("", True)]
    first = next((i for i, (t, _) in enumerate(outs) if t), None)
    return "".join(t for t, _ in outs), [c for _, cs in outs for c in cs], first


@pytest.mark.parametrize("step", [1, 3, 50])
@pytest.mark.parametrize("text", CALLS + TEXTS)
def test_streaming_decides_as_parsing_does(text, step):
    content, calls = JsonCallParser(get_tool_parser("auto"), TOOLS).parse(text)
    got, got_calls, _ = _streamed(text, step)
    assert [c["function"] for c in got_calls] == [c["function"] for c in calls]
    assert got == (content or "")
    assert all(c["index"] == i for i, c in enumerate(got_calls))


def test_text_that_cannot_become_a_call_is_not_held():
    _, _, first = _streamed("The weather in Paris is sunny today, as it often is.", 3)
    assert first == 0
    _, _, first = _streamed('```json\n{"name": "John", "age": 30}\n```', 3)
    assert first is not None and first < 8  # released once the name is known to be no tool's
    _, _, first = _streamed('```python\nprint("hi")\n```', 3)
    assert first is not None and first < 4


def test_tags_still_win():
    text = f"<tool_call>\n{CALL}\n</tool_call>"
    content, calls = JsonCallParser(get_tool_parser("auto"), TOOLS).parse(text)
    assert content is None and len(calls) == 1
    _, got_calls, _ = _streamed(text, 4)
    assert len(got_calls) == 1


def _conversation(*tail: dict) -> list[ChatMessage]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    head = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]}]
    return [ChatMessage.model_validate(m) for m in head + list(tail)]


def test_only_a_bare_repeat_of_a_call_just_answered_counts_as_a_repeat():
    result = {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}
    answered = answered_calls(_conversation(result))
    assert answered == [("get_weather", {"city": "Paris"})]
    for text in (CALL, f"```json\n{CALL}\n```", '{"arguments": {"city": "Paris"}, "name": "get_weather"}'):
        assert repeats_answered_call(text, SCHEMAS, answered)
    for text in ('{"name": "get_weather", "arguments": {"city": "Lyon"}}', "It is 18 degrees and sunny.",
                 f"<tool_call>\n{CALL}\n</tool_call>"):
        assert not repeats_answered_call(text, SCHEMAS, answered)
    # a call is answered only while nothing but its results follows it
    assert answered_calls(_conversation()) == []
    assert answered_calls(_conversation(result, {"role": "user", "content": "And in Lyon?"})) == []


def test_schema_problems_are_named():
    assert schema_problem(WEATHER) is None
    assert "nonsense" in schema_problem({"type": "nonsense"})
    assert schema_problem([1]) is not None


# ---------------------------------------------------------------- the default model, through the openai client
@pytest.fixture(scope="module")
def default_client():
    import openai

    from specdecode.entrypoints.openai.api_server import build_app
    from test_server import serve

    # the default target alone: greedy text is the same with its draft (tests/test_exactness.py), and the call is
    # read from the text
    with serve(build_app({"speculative_method": "none"}, "default")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)


def _ask(client, messages, stream=False):
    kw = dict(model="default", messages=messages, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=64)
    if not stream:
        return client.chat.completions.create(**kw).choices[0]
    calls, text, finish = {}, [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            for c in choice.delta.tool_calls or []:
                calls.setdefault(c.index, {"name": "", "arguments": ""})
                calls[c.index]["name"] += c.function.name or ""
                calls[c.index]["arguments"] += c.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, "".join(text), finish


def test_the_default_model_calls_a_tool_under_auto(default_client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = _ask(default_client, question)
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"

    calls, text, finish = _ask(default_client, question, stream=True)
    assert finish == "tool_calls" and text == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(call.function.name, json.loads(call.function.arguments))]


def test_a_two_turn_tool_loop_ends_in_an_answer_from_the_result(default_client):
    """Qwen2.5-Coder 1.5B calls get_weather again after its result; the server answers that turn again with the
    tools left out (serving_chat.UnlessRepeated), and the answer uses the result, plain and streamed."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    (call,) = _ask(default_client, question).message.tool_calls
    loop = question + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id,
         "content": '{"city": "Paris", "temperature_c": 18, "conditions": "sunny"}'}]
    choice = _ask(default_client, loop)
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "18" in choice.message.content and "sunny" in choice.message.content
    calls, text, finish = _ask(default_client, loop, stream=True)
    assert not calls and finish == "stop" and text == choice.message.content


def test_the_default_model_keeps_example_json_as_text(default_client):
    question = [{"role": "user", "content": "Show me an example JSON object with a name and an age"}]
    choice = _ask(default_client, question)
    assert not choice.message.tool_calls and '"age"' in choice.message.content
    calls, text, _ = _ask(default_client, question, stream=True)
    assert not calls and text == choice.message.content
