"""Tool calling: the Hermes parser (whole and streamed), tool_choice "required" / named enforced by the grammar,
and the server's tool_calls through the official openai client."""
from __future__ import annotations

import json

import pytest

from helpers_spec import one_thread, sharp_draft, sharp_target  # noqa: F401  (fixtures)

from specdecode.structured.tools import HermesToolParser, get_tool_parser, tool_call_constraint

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
UNITS = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_units", "parameters": UNITS}}]
PARAMS = {"get_weather": WEATHER, "set_units": UNITS}
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "set_units", "arguments": {"unit": "C"}}\n</tool_call>')


def test_hermes_parse():
    content, calls = HermesToolParser().parse(TEXT)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("set_units", {"unit": "C"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # no call, or a block that is not a call: plain content
    assert HermesToolParser().parse("hello") == ("hello", [])
    assert HermesToolParser().parse("<tool_call>nope</tool_call>") == ("<tool_call>nope</tool_call>", [])


@pytest.mark.parametrize("step", [1, 2, 5, 11, 1000])
def test_hermes_stream_matches_parse(step):
    p = HermesToolParser()
    content, calls = "", []
    for i in range(0, len(TEXT), step):
        c, k = p.stream(TEXT[i:i + step], False)
        assert "<" not in c, "call markup leaked into streamed content"
        content += c
        calls += k
    c, k = p.stream("", True)
    content, calls = content + c, calls + k
    assert content.strip() == "Let me check."
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "set_units"]


@pytest.mark.parametrize("step", [1, 7, 1000])
def test_one_call_at_most_when_parallel_calls_are_off(step):
    """parallel_tool_calls false (max_calls 1): the first call only, and the later call's markup never shows."""
    content, calls = HermesToolParser(max_calls=1).parse(TEXT)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather"]
    p, streamed, got = HermesToolParser(max_calls=1), "", []
    for i in range(0, len(TEXT), step):
        c, k = p.stream(TEXT[i:i + step], False)
        streamed, got = streamed + c, got + k
    c, k = p.stream("", True)
    assert (streamed + c).strip() == "Let me check." and [x["function"]["name"] for x in got + k] == ["get_weather"]


def test_server_keeps_one_call_when_parallel_calls_are_off(url):
    """In auto mode the output is free, so two calls can come out; with parallel_tool_calls false the answer
    carries the first one only, streamed or not."""
    two = ['<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
           '<tool_call>{"name": "set_units", "arguments": {"unit": "C"}}</tool_call>']
    kw = dict(model="tiny", messages=HISTORY, tools=TOOLS, max_tokens=400, extra_body={"guided_choice": two})
    client = _client(url)
    both = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [c.function.name for c in both] == ["get_weather", "set_units"]
    one = client.chat.completions.create(parallel_tool_calls=False, **kw).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"] and not one.message.content
    names = [d.function.name for ch in client.chat.completions.create(parallel_tool_calls=False, stream=True, **kw)
             if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert names == ["get_weather"]


def test_unknown_parser():
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def test_parser_registry():
    """--tool-call-parser names a registered class ("auto": hermes); another format is one registered class."""
    from specdecode.structured import tools

    assert tools.resolve_tool_parser("auto") is HermesToolParser is tools.resolve_tool_parser("Hermes")

    @tools.register_tool_parser("hermes_test_copy")
    class Copy(HermesToolParser):
        pass

    try:
        assert "hermes_test_copy" in tools.tool_parser_names()
        assert isinstance(get_tool_parser("hermes_test_copy"), Copy)
        assert Copy.constraint(TOOLS, "set_units").key == tool_call_constraint(TOOLS, "set_units").key
    finally:
        del tools.TOOL_PARSERS["hermes_test_copy"]


def test_unknown_parser_is_a_one_line_startup_error(capsys):
    from specdecode.entrypoints.cli import main
    from specdecode.entrypoints.openai.api_server import build_app

    assert main(["serve", "--tool-call-parser", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tool-call-parser" in err[0] and "auto, hermes" in err[0], err
    with pytest.raises(ValueError, match="Unknown tool call parser 'nope'; valid parsers: auto, hermes"):
        build_app({"model": "/nonexistent"}, tool_call_parser="nope")  # before any model loads
    from specdecode.entrypoints.cli import build_parser
    args = build_parser().parse_args(["serve", "--tool-call-parser", "hermes"])
    assert getattr(args, "server.tool_call_parser") == "hermes"


@pytest.fixture(scope="module")
def llm(one_thread, sharp_target, sharp_draft):
    from specdecode import LLM
    return LLM(str(sharp_target), speculative_model=str(sharp_draft), num_speculative_tokens=4, max_model_len=512)


@pytest.mark.parametrize("name", [None, "set_units", "get_weather"])
def test_required_and_named_calls_follow_the_parameters(llm, name):
    from specdecode import SamplingParams

    params = SamplingParams(temperature=0.9, seed=3, max_tokens=200,
                            structured_outputs=tool_call_constraint(TOOLS, name, parallel=False))
    out = llm.generate(prompt_token_ids=[[17, 42, 99, 17]], sampling_params=params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    content, calls = HermesToolParser().parse(out.text)
    assert content is None and len(calls) == 1
    fn = calls[0]["function"]
    assert name is None or fn["name"] == name
    jsonschema.validate(json.loads(fn["arguments"]), PARAMS[fn["name"]])


@pytest.fixture(scope="module")
def url(one_thread, sharp_target, sharp_draft):
    from test_server import serve

    from specdecode.entrypoints.openai.api_server import build_app

    kw = {"model": str(sharp_target), "speculative_model": "[ngram]", "num_speculative_tokens": 4,
          "max_model_len": 512, "max_num_seqs": 4}
    with serve(build_app(kw, "tiny", None)) as u:
        yield u


def _client(url: str):
    import openai
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
           {"role": "user", "content": "And Paris, in Fahrenheit?"}]


# A template that prints the calls as Qwen2.5's does: arguments through tojson.
TOOL_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% for c in m.tool_calls or [] %}"
                 '<tool_call>{"name": {{ c.function.name | tojson }}, "arguments": {{ c.function.arguments | tojson }}}'
                 "</tool_call>{% endfor %}<|end|>{% endfor %}")


def test_history_tool_call_arguments_reach_the_template_as_objects(sharp_target):
    """The spec sends an earlier call's arguments as a JSON string; the server parses it (as vLLM does) so
    that the template prints the object, not a string inside a string."""
    from types import SimpleNamespace

    from specdecode.entrypoints.openai.errors import APIError
    from specdecode.entrypoints.openai.serving_engine import OpenAIServing
    from specdecode.entrypoints.openai.protocol import ChatCompletionRequest
    from specdecode.tokenizer import load_tokenizer

    tok = load_tokenizer(sharp_target, False)
    tok.chat_template = TOOL_TEMPLATE
    server = SimpleNamespace(tokenizer=tok)  # chat_prompt renders with the server's tokenizer only
    body = ChatCompletionRequest(messages=HISTORY, add_generation_prompt=False)
    prompt = OpenAIServing.chat_prompt(server, body)
    assert '"arguments": {"city": "Oslo", "days": 1}' in prompt, prompt
    assert '\\"' not in prompt, prompt
    for bad in ("{city: Oslo}", '"Oslo"', "[1, 2]"):
        history = json.loads(json.dumps(HISTORY))
        history[1]["tool_calls"][0]["function"]["arguments"] = bad
        with pytest.raises(APIError) as e:
            OpenAIServing.chat_prompt(server, ChatCompletionRequest(messages=history))
        assert e.value.status == 400 and e.value.param == "messages.1.tool_calls.0.function.arguments", bad


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_units"}}])
def test_server_tool_calls_validate(url, choice):
    client = _client(url)
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=HISTORY, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False,
                                           temperature=0.8, seed=seed, max_tokens=300)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch
        for call in ch.message.tool_calls:
            if isinstance(choice, dict):
                assert call.function.name == "set_units"
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_server_streams_tool_call_deltas(url):
    client = _client(url)
    kw = dict(model="tiny", messages=HISTORY, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_tokens=300)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            assert not (ch.delta.content or "").strip().startswith("<tool_call>")
            for d in ch.delta.tool_calls or []:
                calls[d.index] = (d.function.name, d.function.arguments)
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [(c.function.name, c.function.arguments) for c in whole]


def test_server_tool_errors(url):
    import httpx

    msgs = [{"role": "user", "content": "hi"}]
    bad = [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
           ({"tool_choice": "required"}, "tools"),
           ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "constraint"),
           ({"chat_template_kwargs": {"tools": []}}, "tools")]
    for extra, needle in bad:
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 4,
                                                            **extra}, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (extra, r.text)
    # the error names the field: tool_choice, or the tool whose parameters the grammar cannot take
    bad_tool = {"type": "function", "function": {"name": "odd", "parameters": {"type": "nonsense"}}}
    for extra, param in (({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                          "tool_choice.function.name"),
                         ({"tool_choice": "required"}, "tool_choice"),
                         ({"tools": TOOLS + [bad_tool], "tool_choice": "required"}, "tools.2.function.parameters"),
                         ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
                         # a client's own template would run in the server: refused, as are tokenizer options
                         ({"chat_template_kwargs": {"chat_template": "{{ 'a' * 500000000 }}"}},
                          "chat_template_kwargs.chat_template"),
                         ({"chat_template_kwargs": {"return_tensors": "pt"}}, "chat_template_kwargs.return_tensors"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages")):
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 4,
                                                            **extra}, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and "/project/cpp" not in err["message"], (extra, err)
    # tool_choice "none": a plain answer, no calls parsed
    r = _client(url).chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="none",
                                             max_tokens=5, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(f"{url}/health").status_code == 200
