"""Anthropic's Messages API on a real server (a tiny model with a draft model speculating): the official anthropic
SDK, the same greedy text as /v1/chat/completions, tools enforced by the grammar, Anthropic-shaped errors,
metrics and the prefix cache."""
from __future__ import annotations

import json

import httpx
import pytest

from helpers_spec import one_thread, sharp_draft, sharp_target  # noqa: F401  (fixtures)
from test_server import scrape, serve_pair
from test_tools import PARAMS as SCHEMAS, UNITS, WEATHER

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny"
# Sampling parameters are not in the SDK's signature (current Claude models take none); clients send them as
# extra body fields, and the server takes them.
GREEDY = {"temperature": 0}
KEY = "sk-test-key"
TOOLS = [{"name": "get_weather", "description": "forecast", "input_schema": WEATHER},
         {"name": "set_units", "input_schema": UNITS}]
SYSTEM = "You are a terse assistant that answers about the weather. " * 4
TURNS = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Rain, 12 degrees."},
         {"role": "user", "content": "And in Paris?"}]


@pytest.fixture(scope="module")
def url(one_thread, sharp_target, sharp_draft):
    with serve_pair(sharp_target, sharp_draft, MODEL, KEY) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


def _chat(url: str, messages: list[dict], **kw) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, **kw},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_returns_text_and_usage_and_equals_chat_completions(url, client):
    """Greedy, with speculation on: the same text as /v1/chat/completions for the same conversation."""
    m = client.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, messages=TURNS, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and _text(m)
    assert m.stop_reason in ("end_turn", "max_tokens")
    prompt = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert prompt > 20 and 1 <= m.usage.output_tokens <= 24
    chat = _chat(url, [{"role": "system", "content": SYSTEM}, *TURNS], max_tokens=24, temperature=0)
    assert _text(m) == chat["message"]["content"]
    assert (m.stop_reason == "max_tokens") == (chat["finish_reason"] == "length")
    # system as text blocks, content as text blocks: the same prompt
    again = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY,
                                   system=[{"type": "text", "text": SYSTEM}],
                                   messages=[{"role": t["role"], "content": [{"type": "text", "text": t["content"]}]}
                                             for t in TURNS])
    assert _text(again) == _text(m)


def test_stream_yields_the_same_text(url, client):
    kw = dict(model=MODEL, max_tokens=30, system=SYSTEM, messages=TURNS, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) >= 1 and "".join(pieces) == _text(whole) == _text(final)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # the wire: Anthropic's event names, in order
    kw.pop("extra_body")
    with httpx.stream("POST", f"{url}/v1/messages", json=dict(kw, stream=True, **GREEDY), headers={"x-api-key": KEY},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[2:-3]) == {"content_block_delta"}
    assert datas[0]["message"]["usage"]["input_tokens"] + datas[0]["message"]["usage"]["cache_read_input_tokens"] \
        == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert datas[-2]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_stop_sequences(client):
    kw = dict(model=MODEL, max_tokens=30, messages=TURNS, extra_body=GREEDY)
    text = _text(client.messages.create(**kw))
    stop = text[5:8]
    assert len(stop) == 3 and text.find(stop) >= 1
    for m in (client.messages.create(stop_sequences=[stop], **kw),
              client.messages.stream(stop_sequences=[stop], **kw).__enter__().get_final_message()):
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
        assert _text(m) == text[:text.find(stop)]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "set_units"}])
def test_forced_tool_call_follows_the_schema(client, choice):
    for temperature in (0.0, 1.0, 1.0):
        m = client.messages.create(model=MODEL, max_tokens=200, messages=[TURNS[0]], tools=TOOLS,
                                   tool_choice=dict(choice, disable_parallel_tool_use=True),
                                   extra_body={"temperature": temperature})
        assert m.stop_reason == "tool_use", m
        uses = [b for b in m.content if b.type == "tool_use"]
        assert len(uses) == 1 and uses[0].id.startswith("toolu_")
        assert choice["type"] == "any" or uses[0].name == "set_units"
        jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])


def test_streamed_tool_call_matches_the_whole_one(client):
    kw = dict(model=MODEL, max_tokens=200, messages=[TURNS[0]], tools=TOOLS, extra_body=GREEDY,
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [(b.name, b.input) for b in whole.content if b.type == "tool_use"]


def test_tool_result_turn_gets_a_final_answer(url, client):
    first = client.messages.create(model=MODEL, max_tokens=200, messages=[TURNS[0]], tools=TOOLS, extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    use = first.content[0]
    history = [TURNS[0], {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain, 12 C"},
                                            {"type": "text", "text": "Summarise."}]}]
    final = client.messages.create(model=MODEL, max_tokens=24, messages=history, tools=TOOLS, extra_body=GREEDY)
    assert final.stop_reason in ("end_turn", "max_tokens") and _text(final)
    # the tool's answer reached the prompt as a tool message, as on the chat route: the same prompt, the same text
    chat_tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
                  for t in TOOLS]
    chat_history = [TURNS[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "rain, 12 C"}, {"role": "user", "content": "Summarise."}]
    tok = httpx.post(f"{url}/tokenize", json={"messages": chat_history, "tools": chat_tools},
                     headers={"x-api-key": KEY}).json()
    assert "rain, 12 C" in httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]},
                                      headers={"x-api-key": KEY}).json()["prompt"]
    assert client.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS).input_tokens == tok["count"] == \
        final.usage.input_tokens + final.usage.cache_read_input_tokens
    chat = _chat(url, chat_history, max_tokens=24, temperature=0, tools=chat_tools)
    assert _text(final) == chat["message"]["content"]


def test_count_tokens_is_the_prompt_a_request_takes(url, client):
    m = client.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, messages=TURNS, extra_body=GREEDY)
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=TURNS)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    tok = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "system", "content": SYSTEM}, *TURNS]},
                     headers={"x-api-key": KEY}).json()
    assert tok["count"] == counted.input_tokens


def test_prefix_cache_and_metrics_apply(url, client):
    before = scrape(url)
    kw = dict(model=MODEL, max_tokens=6, system=SYSTEM + " Prefix cache check.", messages=TURNS, extra_body=GREEDY)
    first, second = client.messages.create(**kw), client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        s.get_final_message()
    after = scrape(url)
    assert second.usage.cache_read_input_tokens >= 32 and second.usage.cache_read_input_tokens > \
        first.usage.cache_read_input_tokens
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= \
        second.usage.cache_read_input_tokens
    done = sum(after[k] - before.get(k, 0) for k in after if k.startswith("vllm:request_success_total"))
    assert done == 3
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == \
        first.usage.output_tokens * 3
    assert after["vllm:spec_decode_num_draft_tokens_total"] > before["vllm:spec_decode_num_draft_tokens_total"]
    # an error on the new route is counted as on the old ones
    httpx.post(f"{url}/v1/messages", json={"model": MODEL, "messages": TURNS}, headers={"x-api-key": KEY})
    assert scrape(url)['specdecode:request_errors_total{status="400"}'] == \
        before.get('specdecode:request_errors_total{status="400"}', 0) + 1


def _anthropic_err(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]["message"]


OK = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body,needle", [
    ({**OK, "foo": 1}, "'foo'"),
    ({**OK, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "'thinking'"),
    ({**OK, "messages": [{"role": "user", "content": "hi", "name": "x"}]}, "'messages.0.name'"),
    ({k: v for k, v in OK.items() if k != "max_tokens"}, "max_tokens"),
    ({**OK, "max_tokens": 0}, "max_tokens"),
    ({**OK, "max_tokens": "8"}, "max_tokens"),
    ({k: v for k, v in OK.items() if k != "model"}, "model"),
    ({**OK, "messages": []}, "messages"),
    ({**OK, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "assistant"),
    ({**OK, "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]},
                         {"role": "user", "content": "hi"}]}, "user messages"),
    ({**OK, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, "prefill"),
    ({**OK, "temperature": 1.5}, "temperature"),
    ({**OK, "top_p": 0}, "top_p"),
    ({**OK, "stop_sequences": [""]}, "stop"),
    ({**OK, "tool_choice": {"type": "any"}}, "tools"),
    ({**OK, "tools": TOOLS, "tool_choice": {"type": "tool"}}, "name"),
    ({**OK, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({**OK, "tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({**OK, "tools": [{"name": "f"}]}, "input_schema"),
    ({**OK, "tools": [{"name": "f", "input_schema": {"type": "nonsense"}}], "tool_choice": {"type": "any"}},
     "schema"),
    ({**OK, "stream": "yes"}, "stream"),
])
def test_malformed_requests_get_anthropic_shaped_400s(url, body, needle):
    r = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    msg = _anthropic_err(r, 400, "invalid_request_error")
    assert needle in msg, msg
    assert "Traceback" not in msg and "/project/cpp" not in msg


def test_other_errors_keep_anthropics_shape(url, client):
    headers = {"x-api-key": KEY}
    _anthropic_err(httpx.post(f"{url}/v1/messages", content=b"{not json", headers=headers), 400,
                   "invalid_request_error")
    _anthropic_err(httpx.post(f"{url}/v1/messages", json=[1], headers=headers), 400, "invalid_request_error")
    for raw in (b"[" * 100000 + b"]" * 100000, b'{"model": "\xff\xfe"}'):  # nested too deeply; not UTF-8
        _anthropic_err(httpx.post(f"{url}/v1/messages", content=raw, headers=dict(headers, **{
            "content-type": "application/json"})), 400, "invalid_request_error")
    assert "application/xml" in _anthropic_err(httpx.post(f"{url}/v1/messages", content=json.dumps(OK).encode(),
                                                          headers=dict(headers, **{"content-type": "application/xml"})),
                                               415, "invalid_request_error")
    _anthropic_err(httpx.post(f"{url}/v1/messages", json=OK), 401, "authentication_error")
    _anthropic_err(httpx.post(f"{url}/v1/messages", json=OK, headers={"x-api-key": "wrong"}), 401,
                   "authentication_error")
    _anthropic_err(httpx.post(f"{url}/v1/messages/count_tokens", json={**OK, "max_tokens": 3}, headers=headers), 400,
                   "invalid_request_error")
    assert "claude-x" in _anthropic_err(httpx.post(f"{url}/v1/messages", json={**OK, "model": "claude-x"},
                                                   headers=headers), 404, "not_found_error")
    _anthropic_err(httpx.get(f"{url}/v1/messages", headers=headers), 405, "invalid_request_error")
    # Bearer works too, and the OpenAI routes keep OpenAI's shape
    assert httpx.post(f"{url}/v1/messages", json=OK, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert set(httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, headers=headers).json()) == {"error"}
    # the SDK reads the errors as its own
    with pytest.raises(anthropic.BadRequestError, match="'foo'"):
        client.messages.create(model=MODEL, max_tokens=4, messages=TURNS, extra_body={"foo": 1})
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=TURNS)
    # accepted although they do nothing here: metadata and cache_control
    m = client.messages.create(model=MODEL, max_tokens=4, metadata={"user_id": "u1"}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}])
    assert m.usage.output_tokens >= 1


def test_prefill_continues_the_final_assistant_message(url, client):
    turns = [TURNS[0], {"role": "assistant", "content": "It is"}]
    m = client.messages.create(model=MODEL, max_tokens=12, messages=turns, extra_body=GREEDY)
    chat = _chat(url, turns, max_tokens=12, temperature=0, continue_final_message=True, add_generation_prompt=False)
    assert _text(m) == chat["message"]["content"]
