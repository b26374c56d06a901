"""OpenAI's Responses API on a real server (a tiny model with a draft model speculating): the official openai SDK,
the same greedy text as /v1/chat/completions, function tools enforced by the grammar, text.format json_schema,
stored responses, errors, metrics and the prefix cache."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from helpers_spec import one_thread, sharp_draft, sharp_target  # noqa: F401  (fixtures)
from test_server import _err, scrape, serve_pair

from test_tools import PARAMS as SCHEMAS, UNITS, WEATHER

jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny"
TOOLS = [{"type": "function", "name": "get_weather", "description": "forecast", "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "set_units", "parameters": UNITS, "strict": True}]
INSTRUCTIONS = "You are a terse assistant that answers about the weather. " * 4
TURNS = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Rain, 12 degrees."},
         {"role": "user", "content": "And in Paris?"}]


@pytest.fixture(scope="module")
def url(one_thread, sharp_target, sharp_draft):
    with serve_pair(sharp_target, sharp_draft, MODEL) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, messages: list[dict], **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, **kw).choices[0]


def test_create_returns_output_text_equal_to_chat_completions(client):
    """Greedy, with speculation on: the same text as /v1/chat/completions for the same conversation."""
    r = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=TURNS, max_output_tokens=24,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL and r.output_text
    assert r.status in ("completed", "incomplete") and [o.type for o in r.output] == ["message"]
    assert r.usage.input_tokens > 20 and 1 <= r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    chat = _chat(client, [{"role": "system", "content": INSTRUCTIONS}, *TURNS], max_tokens=24, temperature=0)
    assert r.output_text == chat.message.content
    assert (r.status == "incomplete") == (chat.finish_reason == "length")
    assert r.status != "incomplete" or r.incomplete_details.reason == "max_output_tokens"
    # a string input is one user message; input_text parts are its text
    one = client.responses.create(model=MODEL, input="Weather in Oslo?", max_output_tokens=12, temperature=0)
    parts = client.responses.create(model=MODEL, max_output_tokens=12, temperature=0, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]}])
    assert one.output_text == parts.output_text == _chat(client, TURNS[:1], max_tokens=12,
                                                          temperature=0).message.content


def test_stream_yields_deltas_and_completed(client):
    kw = dict(model=MODEL, instructions=INSTRUCTIONS, input=TURNS, max_output_tokens=30, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 1 and "".join(deltas) == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    # the SDK's own stream helper accumulates it the same way
    with client.responses.stream(**kw) as s:
        events = list(s)
    assert [e.snapshot for e in events if e.type == "response.output_text.delta"][-1] == whole.output_text
    assert events[-1].type == kinds[-1] and events[-1].response.output_text == whole.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_round_trip(client, stream):
    kw = dict(model=MODEL, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0,
              max_output_tokens=200)
    items: list = [{"role": "user", "content": "Weather in Oslo?"}]
    if stream:
        events = list(client.responses.create(input=items, stream=True, **kw))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
        first = events[-1].response
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert args == first.output[0].arguments
    else:
        first = client.responses.create(input=items, **kw)
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1 and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    # the SDK's items go back as input, with the function's output
    items += first.output
    items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"forecast": "rain"}'})
    second = client.responses.create(model=MODEL, input=items, tools=TOOLS, temperature=0, max_output_tokens=16)
    assert second.output_text and second.status in ("completed", "incomplete")
    # the same conversation on the chat route: the same prompt and the same answer
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function",
                "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
               {"role": "tool", "tool_call_id": calls[0].call_id, "content": '{"forecast": "rain"}'}]
    chat = client.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=16, tools=[
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_named_function_and_json_schema_format(client):
    r = client.responses.create(model=MODEL, input="units?", tools=TOOLS, temperature=1.0, max_output_tokens=200,
                                tool_choice={"type": "function", "name": "set_units"}, parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["set_units"]
    jsonschema.validate(json.loads(calls[0].arguments), UNITS)
    r = client.responses.create(model=MODEL, input="weather?", temperature=1.0, max_output_tokens=200,
                                text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    assert r.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(url, client):
    first = client.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=TURNS[0]["content"],
                                    max_output_tokens=8, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input=TURNS[2]["content"],
                                     max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    chat = _chat(client, [TURNS[0], {"role": "assistant", "content": first.output_text}, TURNS[2]], max_tokens=8,
                 temperature=0)
    assert second.output_text == chat.message.content  # instructions are not carried over, as OpenAI does
    assert client.responses.retrieve(second.id).output_text == second.output_text
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError, match="not found") as e:
            client.responses.create(model=MODEL, input="x", previous_response_id=missing, max_output_tokens=2)
        assert e.value.body["param"] == "previous_response_id"
    _err(httpx.get(f"{url}/v1/responses/{unstored.id}"), 404, "not_found")


def test_prefix_cache_and_metrics_apply(url, client):
    before = scrape(url)
    kw = dict(model=MODEL, instructions=INSTRUCTIONS + " Cache check.", input=TURNS, max_output_tokens=6,
              temperature=0)
    first, second = client.responses.create(**kw), client.responses.create(**kw)
    list(client.responses.create(stream=True, **kw))
    after = scrape(url)
    assert second.usage.input_tokens_details.cached_tokens >= 32
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens_details.cached_tokens
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= \
        second.usage.input_tokens_details.cached_tokens
    assert sum(after[k] - before.get(k, 0) for k in after if k.startswith("vllm:request_success_total")) == 3
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == \
        3 * first.usage.output_tokens
    assert after["vllm:spec_decode_num_draft_tokens_total"] > before["vllm:spec_decode_num_draft_tokens_total"]
    httpx.post(f"{url}/v1/responses", json={"model": MODEL})
    assert scrape(url)['specdecode:request_errors_total{status="400"}'] == \
        before.get('specdecode:request_errors_total{status="400"}', 0) + 1


OK = {"model": MODEL, "input": "hi", "max_output_tokens": 4}


@pytest.mark.parametrize("body,param,needle", [
    ({**OK, "foo": 1}, "foo", "'foo'"),
    ({**OK, "reasoning": {"effort": "low"}}, "reasoning", "'reasoning'"),
    ({**OK, "background": True}, "background", "'background'"),
    ({**OK, "include": ["message.output_text.logprobs"]}, "include", "'include'"),
    ({**OK, "truncation": "auto"}, "truncation", "truncation"),
    ({k: v for k, v in OK.items() if k != "input"}, "input", "input"),
    ({**OK, "input": []}, "input", "input"),
    ({**OK, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, None, "image_url"),
    ({**OK, "input": [{"type": "reasoning", "summary": []}]}, None, "reasoning"),
    ({**OK, "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, None, "JSON"),
    ({**OK, "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({**OK, "max_output_tokens": "4"}, "max_output_tokens", "max_output_tokens"),
    ({**OK, "temperature": -1}, "temperature", "temperature"),
    ({**OK, "stream": "yes"}, "stream", "stream"),
    ({**OK, "tools": [{"type": "web_search"}]}, "tools.0.type", "'function'"),
    ({**OK, "tool_choice": "required"}, "tool_choice", "tools"),
    ({**OK, "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name", "nope"),
    ({**OK, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({**OK, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format.schema", "nonsense"),
    ({**OK, "tools": [{**TOOLS[0], "parameters": {"type": "nonsense"}}], "tool_choice": "required"},
     "tools.0.parameters", "nonsense"),
    ({**OK, "previous_response_id": "resp_missing"}, "previous_response_id", "not found"),
])
def test_malformed_requests_get_400s_naming_the_field(url, body, param, needle):
    err = _err(httpx.post(f"{url}/v1/responses", json=body, timeout=60), 400)
    assert needle in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    assert "Traceback" not in err["message"] and "/project/cpp" not in err["message"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_unreadable_bodies_get_400s(url):
    for raw in (b"[" * 100000 + b"]" * 100000, b'{"model": "\xff\xfe"}', b"{not json"):
        _err(httpx.post(f"{url}/v1/responses", content=raw, headers={"content-type": "application/json"}), 400,
             "invalid_json")
    _err(httpx.post(f"{url}/v1/responses", json=["hi"]), 400)
    _err(httpx.post(f"{url}/v1/responses", content=json.dumps(OK).encode(), headers={"content-type": "text/xml"}),
         415, "unsupported_media_type")
    _err(httpx.get(f"{url}/v1/responses"), 405, "method_not_allowed")
