"""One bad request never hurts the others: isolation in the engine step, validation, limits, queue semantics,
auth, shutdown, and a malformed-input suite against the real server."""
from __future__ import annotations

import contextlib
import http.client
import json
import math
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from specdecode import SamplingParams
from specdecode.engine.llm_engine import LLMEngine
from specdecode.entrypoints.openai.api_server import build_app
from test_server import MAX_LEN, MODEL, _err, _free_port, _server_cmd, serve

MAX_WAITING = 4


# ---------------------------------------------------------------- the engine step
def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def _poisoned(**bad) -> SamplingParams:
    """Params that validation would reject, set after the fact: what reaches the sampler if a check is missed."""
    p = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    for k, v in bad.items():
        setattr(p, k, v)
    return p


@pytest.mark.parametrize("spec", [{"speculative_model": "[ngram]", "num_speculative_tokens": 3}, "draft"])
@pytest.mark.parametrize("bad", [{"temperature": math.nan}, {"repetition_penalty": 1e-39},
                                 {"repetition_penalty": math.nan}])
def test_a_bad_request_fails_alone_in_a_running_batch(tiny_models, tiny_draft, spec, bad):
    if spec == "draft":
        spec = {"speculative_model": str(tiny_draft), "num_speculative_tokens": 3}
    engine = LLMEngine.from_kwargs(model=str(tiny_models["llama"]), max_model_len=256, max_num_seqs=8, **spec)
    good = {f"g{i}": (f"prompt number {i} says", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
            for i in range(3)}
    good |= {f"s{i}": (f"sampled {i} goes", SamplingParams(temperature=0.8, seed=i, max_tokens=20, ignore_eos=True))
             for i in range(3)}
    alone = {rid: _run(engine, {rid: req})[rid].outputs[0].token_ids for rid, req in good.items()}
    # the bad request joins a batch whose streams are already decoding
    for rid, (prompt, params) in good.items():
        engine.add_request(rid, prompt, params)
    engine.step()
    engine.step()
    engine.add_request("bad", "poison", _poisoned(**bad))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    if math.isnan(bad.get("temperature", 0)) or math.isnan(bad.get("repetition_penalty", 0)):
        assert outs["bad"].outputs[0].finish_reason == "error" and "SamplingError" in outs["bad"].error
    else:  # a penalty of 1e-39 overflows only where a seen token has a large enough logit
        assert outs["bad"].outputs[0].finish_reason in ("error", "length")
    for rid in good:
        assert outs[rid].error is None and outs[rid].outputs[0].token_ids == alone[rid], rid
    # and the engine goes on serving
    assert _run(engine, {"after": good["g0"]})["after"].outputs[0].token_ids == alone["g0"]


# ---------------------------------------------------------------- a real server with limits
@pytest.fixture(scope="module")
def hard_kwargs(tiny_models):
    return {"model": str(tiny_models["llama"]), "speculative_model": "[ngram]", "num_speculative_tokens": 3,
            "max_model_len": MAX_LEN, "max_num_seqs": 8, "max_waiting_requests": MAX_WAITING}


BODY_LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def url(hard_kwargs):
    with serve(build_app(hard_kwargs, MODEL, None, max_body_bytes=BODY_LIMIT, body_timeout=2.0)) as u:
        yield u


REFERENCE = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}


def _stream_tokens(url: str, prompt: str, max_tokens: int, gaps: list | None = None,
                   started: threading.Event | None = None) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, last = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if gaps is not None and last is not None:
                gaps.append(now - last)
            last = now
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            text.append(ev["choices"][0]["text"])
            if started is not None:
                started.set()
    return "".join(text)


STREAM_PROMPTS = [f"stream {i} begins with" for i in range(6)]


@pytest.mark.parametrize("bad", [{"temperature": "NaN"}, {"temperature": 1, "repetition_penalty": 1e-39},
                                 {"temperature": 1, "repetition_penalty": "NaN"}])
def test_bad_request_among_six_streams(url, bad):
    alone = [_stream_tokens(url, p, 40) for p in STREAM_PROMPTS]
    with ThreadPoolExecutor(6) as pool:
        started = [threading.Event() for _ in STREAM_PROMPTS]
        futs = [pool.submit(_stream_tokens, url, p, 40, None, e) for p, e in zip(STREAM_PROMPTS, started)]
        assert all(e.wait(120) for e in started)  # the bad request arrives while all six run
        body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4, **bad}).replace('"NaN"', "NaN")
        err = _err(httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}),
                   400)
        assert err["param"] in bad
        assert [f.result(timeout=120) for f in futs] == alone


def test_n_beyond_the_waiting_limit_is_400_and_idle_server_takes_eight(url):
    err = _err(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "n": 5}), 400)
    assert "waiting limit" in err["message"]
    # 8 concurrent requests on an idle server with 8 slots and a waiting limit of 4: all admitted
    with ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda i: httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": f"request {i}", "max_tokens": 8}), range(8)))
    assert [r.status_code for r in rs] == [200] * 8, [r.text for r in rs if r.status_code != 200]


def test_huge_prompt_is_rejected_fast_without_stalling_streams(tiny_models):
    """Default limits, the real server process: a 20 MB prompt gets its error while two running streams are
    still generating, and they see no gap near 2 s; a prompt under the body limit but too long for the context
    is refused before it is tokenized."""
    port = _free_port()
    # Streams long enough (900 tokens each) that a loaded machine still answers both refusals inside them.
    proc = subprocess.Popen(_server_cmd("--model", str(tiny_models["llama"]), "--speculative-model", "[ngram]",
                                        "--num-speculative-tokens", "3", "--port", str(port), "--max-model-len",
                                        "1024", "--served-model-name", MODEL),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    payloads = [(json.dumps({"model": MODEL, "prompt": "ab" * n * 1024 * 1024, "max_tokens": 4}).encode(), status)
                for n, status in ((10, 413), (2, 400))]
    try:
        _wait_healthy(proc, url)
        gaps: list[float] = []
        with ThreadPoolExecutor(3) as pool, httpx.Client(timeout=60) as h:
            started = [threading.Event() for _ in range(2)]
            futs = [pool.submit(_stream_tokens, url, f"story {i}", 900, gaps, e) for i, e in enumerate(started)]
            assert all(e.wait(120) for e in started)
            for payload, status in payloads:
                r = h.post(f"{url}/v1/completions", content=payload, headers={"content-type": "application/json"})
                _err(r, status)
                # Answered within the streams' run, not after it: measured against the engine's own pace on
                # this machine, not a wall-clock bound (the streams' 400 tokens take several times longer).
                assert not any(f.done() for f in futs), (status, "the streams finished first")
            for f in futs:
                f.result(timeout=120)
        assert gaps and max(gaps) < 2.0, max(gaps)
    finally:
        proc.kill()
        proc.wait()


def test_prompt_length_bound_reads_the_vocabulary_only_for_long_prompts(tiny_models):
    """The characters-per-token bound (max_prompt_chars) is only worked out for a prompt longer than
    2 * max_model_len characters, which every bound is at least; shorter ones go straight to the tokenizer."""
    engine = LLMEngine.from_kwargs(model=str(tiny_models["llama"]), max_model_len=64,
                                   speculative_config={"method": "none"}, num_threads=1)
    assert engine.input_processor.encode_prompt("hello there")
    assert "max_prompt_chars" not in engine.input_processor.__dict__  # the vocabulary was not read
    with pytest.raises(ValueError, match="tokens, but max_model_len is 64"):
        engine.input_processor.encode_prompt("ab " * 60)  # 180 characters: under the bound, too many tokens
    with pytest.raises(ValueError, match="characters, more than 64 tokens"):
        engine.input_processor.encode_prompt("x" * (engine.input_processor.max_prompt_chars + 1))


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.time() + 90
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        assert time.time() < deadline, "server did not start"
        time.sleep(0.1)


def test_shutdown_deadline_ends_streams_with_an_error_event(tiny_models):
    port = _free_port()
    proc = subprocess.Popen(_server_cmd("--model", str(tiny_models["llama"]), "--speculative-model", "[ngram]",
                                        "--num-speculative-tokens", "3", "--port", str(port), "--max-model-len",
                                        str(MAX_LEN), "--served-model-name", MODEL, "--timeout-graceful-shutdown",
                                        "1.5", "--max-num-seqs", "1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url)
        # one slow stream: each of many tokens is one step, far longer than the grace period
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_LEN - 20, "stream": True,
                "ignore_eos": True, "temperature": 1.0, "seed": 1}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]", rest[-3:]
        last = json.loads(rest[-2][6:])
        assert "error" in last or last["choices"][-1]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
        # the process is gone within the period asked for (the interpreter's teardown once overran it by ~1 s)
        assert time.monotonic() - signalled <= 1.5, time.monotonic() - signalled
        stderr = proc.stderr.read()
        assert "Traceback" not in stderr, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_auth_is_constant_time_and_covers_the_schema(hard_kwargs):
    with serve(build_app(hard_kwargs, MODEL, "sekret")) as u:
        _err(httpx.get(f"{u}/openapi.json"), 401, "invalid_api_key")
        assert httpx.get(f"{u}/metrics").status_code == 200  # open by default, as in vLLM
        assert httpx.get(f"{u}/health").status_code == 200
        schema = httpx.get(f"{u}/openapi.json", headers={"Authorization": "Bearer sekret"}).json()
        responses = schema["paths"]["/v1/completions"]["post"]["responses"]
        assert "422" not in responses and "400" in responses
    with serve(build_app(hard_kwargs, MODEL, "sekret", metrics_require_key=True)) as u:
        _err(httpx.get(f"{u}/metrics"), 401)
        assert httpx.get(f"{u}/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_no_content_type_is_json_and_slow_body_times_out(url):
    r = httpx.post(f"{url}/v1/completions", content=json.dumps(REFERENCE).encode(), headers={"content-type": ""})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/completions", content=json.dumps(REFERENCE).encode(),
                   headers={"content-type": "application/x-www-form-urlencoded"})  # what curl -d sends
    assert r.status_code == 200, r.text
    # a body that says it is something else is refused by its type, not misread as "not a dictionary"
    err = _err(httpx.post(f"{url}/v1/completions", content=json.dumps(REFERENCE).encode(),
                          headers={"content-type": "application/xml"}), 415, "unsupported_media_type")
    assert "application/xml" in err["message"]
    # a body FastAPI cannot decode at all (not UTF-8) is the same 400 code as malformed JSON
    _err(httpx.post(f"{url}/v1/completions", content=b'{"prompt": "\xff\xfe"}',
                    headers={"content-type": "application/json"}), 400, "invalid_json")

    # A body that stalls after its first chunk: the client sends no more until the server has answered (its
    # body timeout is 2 s), so the stall outlasts the timeout however slowly either side runs.
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("content-type", "application/json")
        conn.putheader("transfer-encoding", "chunked")
        conn.endheaders()
        part = b'{"model": "tiny-llama", '
        conn.send(b"%x\r\n%s\r\n" % (len(part), part))
        stalled = conn.getresponse()  # blocks until the server answers or closes
        _err(httpx.Response(stalled.status, content=stalled.read()), 408, "request_timeout")
    finally:
        conn.close()


# ---------------------------------------------------------------- the malformed-input suite
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _raw(path: str, text: str | bytes, status: int, headers: dict | None = None):
    return (path, text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"), status, headers)


def _json(path: str, body: dict, status: int = 400):
    text = json.dumps({"model": MODEL, **body}, allow_nan=True)
    return _raw(path, text, status)


MALFORMED = [
    # non-finite and out-of-range numbers
    _raw(C, '{"prompt": "x", "temperature": NaN}', 400),
    _raw(C, '{"prompt": "x", "temperature": Infinity}', 400),
    _raw(C, '{"prompt": "x", "temperature": -Infinity}', 400),
    _raw(C, '{"prompt": "x", "temperature": 1e400}', 400),
    _json(C, {"prompt": "x", "temperature": -1}),
    _json(C, {"prompt": "x", "temperature": "hot"}),
    _json(C, {"prompt": "x", "top_p": 0}),
    _json(C, {"prompt": "x", "top_p": 1.5}),
    _raw(C, '{"prompt": "x", "top_p": NaN}', 400),
    _json(C, {"prompt": "x", "top_k": -5}),
    _json(C, {"prompt": "x", "top_k": 1.5}),
    _json(C, {"prompt": "x", "min_p": 2}),
    _raw(C, '{"prompt": "x", "min_p": NaN}', 400),
    _json(C, {"prompt": "x", "presence_penalty": 3}),
    _json(C, {"prompt": "x", "frequency_penalty": -3}),
    _raw(C, '{"prompt": "x", "frequency_penalty": Infinity}', 400),
    _json(C, {"prompt": "x", "repetition_penalty": 0}),
    _json(C, {"prompt": "x", "repetition_penalty": -1}),
    _raw(C, '{"prompt": "x", "repetition_penalty": NaN, "temperature": 0}', 400),
    _raw(C, '{"prompt": "x", "repetition_penalty": Infinity}', 400),
    _json(C, {"prompt": "x", "repetition_penalty": 1e-39, "temperature": 1}),
    _json(C, {"prompt": "x", "repetition_penalty": 1e39}),
    _json(C, {"prompt": "x", "max_tokens": 0}),
    _json(C, {"prompt": "x", "max_tokens": -1}),
    _json(C, {"prompt": "x", "max_tokens": "ten"}),
    _json(C, {"prompt": "x", "max_tokens": 1.5}),
    _json(C, {"prompt": "x", "n": 0}),
    _json(C, {"prompt": "x", "n": 100}),
    _json(C, {"prompt": "x", "n": MAX_WAITING + 1}),
    _json(C, {"prompt": "x", "seed": 2 ** 70}),
    _json(C, {"prompt": "x", "seed": "x"}),
    _json(C, {"prompt": "x", "logprobs": 21}),
    _json(C, {"prompt": "x", "logprobs": -1}),
    # text
    _json(C, {"prompt": "x", "stop": [""]}),
    _json(C, {"prompt": "x", "stop": 5}),
    _raw(C, '{"prompt": "x", "stop": ["a\\ud800"]}', 400),
    _json(C, {"prompt": "x", "stop_token_ids": [-1]}),
    _raw(C, '{"prompt": "ab\\ud800cd"}', 400),
    _raw(C, '{"prompt": ["ok", "ab\\udfffcd"]}', 400),
    _raw(C, '{"prompt": "x", "model": "\\ud800"}', 400),
    # prompts
    _json(C, {"prompt": []}),
    _json(C, {"prompt": [[]]}),
    _json(C, {"prompt": [-1]}),
    _json(C, {"prompt": [10 ** 9]}),
    _json(C, {"prompt": [1.5]}),
    _json(C, {"prompt": None}),
    _json(C, {"max_tokens": 3}),
    _json(C, {"prompt": {"a": 1}}),
    _json(C, {"prompt": [5] * (MAX_LEN + 10)}),
    _json(C, {"prompt": "x", "model": "gpt-9"}, 404),
    # fields we do not implement are refused by name, never ignored
    _json(C, {"prompt": "x", "tools": []}),
    _json(C, {"prompt": "x", "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "s", "schema": {"type": "nonsense"}}}}),
    _json(C, {"prompt": "x", "guided_regex": "(ab"}),
    _json(C, {"prompt": "x", "frobnicate": True}),
    _json(C, {"prompt": "x", "logit_bias": {"1": 500}}),  # logit_bias is implemented: its bad values are refused
    _json(C, {"prompt": "x", "logit_bias": {"99999999": 5}}),
    _json(C, {"prompt": "x", "suffix": "y"}),  # this model has no fill-in-the-middle tokens
    _json(C, {"prompt": "x", "suffix": 5}),
    _raw(C, '{"prompt": "x", "suffix": "a\\ud800"}', 400),
    _json(C, {"prompt": "x", "suffix": "y", "echo": True}),
    _json(C, {"prompt": "x", "best_of": 3}),
    _json(C, {"prompt": "x", "echo": "maybe"}),
    # bodies
    _raw(C, "{", 400),
    _raw(C, "[]", 400),
    _raw(C, "null", 400),
    _raw(C, "", 400),
    _raw(C, b"\xff\xfe\x00", 400),
    _raw(C, "[" * 50000 + "]" * 50000, 400),
    _raw(C, json.dumps({"prompt": "x" * (BODY_LIMIT + 10)}), 413),
    # chat
    _json(CH, {"messages": []}),
    _json(CH, {}),
    _json(CH, {"messages": "hi"}),
    _json(CH, {"messages": [{"content": "no role"}]}),
    _raw(CH, '{"messages": [{"role": "user", "content": "a\\ud800"}]}', 400),
    _raw(CH, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', 400),
    _json(CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    _raw(CH, '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400),
    _json(CH, {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}),
    _json(CH, {"messages": [{"role": "user", "content": " "}], "continue_final_message": True,
               "add_generation_prompt": False}),
    _json(CH, {"messages": [{"role": "user", "content": "x"}], "continue_final_message": "yes please"}),
    _json(CH, {"messages": MSG, "top_logprobs": 5}),
    _json(CH, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "not a name"}}]}),
    _json(CH, {"messages": MSG, "tool_choice": "auto"}),
    _json(CH, {"messages": MSG, "response_format": {"type": "yaml"}}),
    _json(CH, {"messages": MSG, "guided_grammar": 'root ::= "a" | ('}),
    _json(CH, {"messages": MSG, "max_completion_tokens": 0}),
    _json(CH, {"messages": [{"role": "wizard", "content": "hi"}]}),
    _json(CH, {"messages": [{"role": "user", "content": None}]}),
    _json(CH, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    _json(CH, {"messages": MSG + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}),
    _json(CH, {"messages": MSG, "stream_options": {"include_usage": True}}),
    _json(C, {"prompt": "x", "stop_token_ids": [99999999]}),
    _json(CH, {"messages": MSG, "seed": -(2 ** 64)}),
    # routes and methods
    ("/v1/completions", None, 405, None),
    ("/v1/nothing-here", b"{}", 404, None),
    ("/v1/models", b"{}", 405, None),
]


def test_the_suite_is_big_enough():
    assert len(MALFORMED) >= 60


@pytest.fixture(scope="module")
def reference(url):
    r = httpx.post(f"{url}/v1/completions", json=REFERENCE, timeout=60)
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("path,content,status,headers", MALFORMED,
                         ids=[f"{i}-{m[0].rsplit('/', 1)[-1]}-{m[2]}" for i, m in enumerate(MALFORMED)])
def test_malformed_input(url, reference, path, content, status, headers):
    h = {"content-type": "application/json", **(headers or {})}
    if content is None:
        r = httpx.get(f"{url}{path}", timeout=30)
    else:
        r = httpx.post(f"{url}{path}", content=content, headers=h, timeout=30)
    err = _err(r, status)
    assert err["type"] == "invalid_request_error"
    # nothing it did touched anyone else
    assert httpx.get(f"{url}/health").status_code == 200
    again = httpx.post(f"{url}/v1/completions", json=REFERENCE, timeout=60)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference


def test_openai_client_sees_400s(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="repetition_penalty"):
        client.completions.create(model=MODEL, prompt="x", temperature=1, extra_body={"repetition_penalty": 1e-39})


def test_a_405_names_the_allowed_methods(url):
    r = httpx.get(f"{url}/v1/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers.get("allow") == "POST"


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/completions"])
def test_deeply_nested_json_is_a_400_on_every_route(url, path):
    body = "[" * 100_000 + "]" * 100_000
    r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json"


# ---------------------------------------------------------------- strict types and honest limits
WRONG_TYPES = [(path, {field: value}, field) for path in (C, CH) for field, value in (
    ("temperature", True), ("temperature", "0.5"), ("max_tokens", True), ("stream", "yes"), ("stream", 1),
    ("n", "1"))] + [
    (C, {"logprobs": True}, "logprobs"), (CH, {"logprobs": 1}, "logprobs"),
    ("/detokenize", {"tokens": ["12"]}, "tokens.0"), ("/detokenize", {"tokens": [True]}, "tokens.0")]


@pytest.mark.parametrize("path,fields,param", WRONG_TYPES, ids=[f"{p.rsplit('/', 1)[-1]}-{f}" for p, f, _ in
                                                                 [(p, next(iter(b)), q) for p, b, q in WRONG_TYPES]])
def test_wrong_json_types_are_refused_by_name(url, path, fields, param):
    base = {"/detokenize": {}, C: {"prompt": "x"}, CH: {"messages": MSG}}[path]
    err = _err(httpx.post(f"{url}{path}", json={"model": MODEL, **base, **fields}, timeout=30), 400)
    assert err["param"] == param, err


def test_ints_are_still_floats_and_whole_floats_are_ints(url):
    r = httpx.post(f"{url}/v1/completions", json={**REFERENCE, "temperature": 0, "top_p": 1}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/completions", json={**REFERENCE, "max_tokens": 8.0, "n": 1e0}, timeout=60)
    assert r.status_code == 200, r.text
    err = _err(httpx.post(f"{url}/v1/completions", json={**REFERENCE, "max_tokens": 8.5}, timeout=60), 400)
    assert err["param"] == "max_tokens"


@pytest.mark.parametrize("path,fields,param", [
    (C, {"max_tokens": 10 ** 12}, "max_tokens"), (C, {"max_tokens": 2 ** 64 + 1}, "max_tokens"),
    (C, {"max_tokens": 1e12}, "max_tokens"), (C, {"max_tokens": MAX_LEN - 2}, "max_tokens"),
    (CH, {"max_tokens": 10 ** 12}, "max_tokens"), (CH, {"max_completion_tokens": MAX_LEN - 2}, "max_completion_tokens"),
    ("/v1/responses", {"max_output_tokens": 10 ** 12}, "max_output_tokens")])
def test_max_tokens_beyond_the_context_is_a_400(url, path, fields, param):
    base = {C: {"prompt": "Once upon a time"}, CH: {"messages": MSG}, "/v1/responses": {"input": "hi"}}[path]
    err = _err(httpx.post(f"{url}{path}", json={"model": MODEL, **base, **fields}, timeout=30), 400)
    assert err["param"] == param and "too large" in err["message"], err  # 1e12 is a whole number: an integer


def test_max_tokens_is_clamped_only_when_not_given(url):
    prompt = [5] * (MAX_LEN - 4)  # leaves 4 positions, fewer than the default 16
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                  "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


@pytest.mark.parametrize("choice", ["auto", "none", "required", None])
def test_a_nonsense_tool_schema_is_refused_whatever_tool_choice_is(url, choice):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    body = {"model": MODEL, "messages": MSG, "tools": tools, **({"tool_choice": choice} if choice else {})}
    err = _err(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30), 400)
    assert err["param"] == "tools.0.function.parameters" and "nonsense" in err["message"], err
