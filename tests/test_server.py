"""The OpenAI-compatible server, end to end: real uvicorn on 127.0.0.1, the official openai client, httpx."""
from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

from specdecode import LLM, SamplingParams
from specdecode.entrypoints.openai.api_server import build_app

MAX_LEN = 512
MODEL = "tiny-llama"


@contextlib.contextmanager
def serve(app):
    """Runs uvicorn in a thread on a free port; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline and t.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(15)
        sock.close()


@contextlib.contextmanager
def serve_pair(target, draft, model: str, api_key: str | None = None):
    """A server of ``target`` speculating with ``draft`` (k = 4, 4 requests at once) as ``model``; yields its URL."""
    kw = {"model": str(target), "speculative_model": str(draft), "num_speculative_tokens": 4,
          "max_model_len": 512, "max_num_seqs": 4}
    with serve(build_app(kw, model, api_key)) as url:
        yield url


@pytest.fixture(scope="module")
def engine_kwargs(tiny_models, tiny_draft):
    return {"model": str(tiny_models["llama"]), "speculative_model": str(tiny_draft), "num_speculative_tokens": 3,
            "max_model_len": MAX_LEN, "max_num_seqs": 8, "max_waiting_requests": 64}


@pytest.fixture(scope="module")
def url(engine_kwargs):
    with serve(build_app(engine_kwargs, MODEL, None)) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(engine_kwargs):
    return LLM(**engine_kwargs)


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (model_name label dropped)."""
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, val = line.rsplit(" ", 1)
        key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "").replace(",}", "}")
        out[key] = float(val)
    return out


def sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "Speculative decoding drafts"]


# ---------------------------------------------------------------- basics
def test_models_and_health(url, client):
    assert httpx.get(f"{url}/health").status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == MAX_LEN
    one = client.models.retrieve(MODEL)  # GET /v1/models/{id}
    assert one.id == MODEL and one.max_model_len == MAX_LEN
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and "no-such-model" in e.value.body["message"]


def test_completion_greedy_matches_offline(client, offline):
    want = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, w in zip(PROMPTS, want):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == w.outputs[0].text
        assert r.usage.completion_tokens == len(w.outputs[0].token_ids)
        assert r.usage.prompt_tokens == len(w.prompt_token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.choices[0].finish_reason in ("stop", "length")
        spec = r.model_extra["spec_decode"]
        assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    # a list of prompts in one request: one choice per prompt, in order
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=24, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [w.outputs[0].text for w in want[:2]]
    # token-id prompts
    ids = list(want[0].prompt_token_ids)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert r.choices[0].text == want[0].outputs[0].text


def test_chat_greedy_matches_offline(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert "spec_decode" in r.model_extra
    # max_completion_tokens wins over max_tokens; content parts are joined
    parts = [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story."}]
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=50,
                                       max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_continue_final_message_goes_on_from_the_last_message(url, client, offline):
    """vLLM's continue_final_message: the prompt ends inside the last message, so the answer continues it. The
    server, LLM.chat and /tokenize agree on the prompt; with add_generation_prompt left on it is a 400."""
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon"}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False,
                        add_generation_prompt=False, continue_final_message=True)[0]
    assert want.prompt.endswith("<|assistant|>Once upon")
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=extra)
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    tok = httpx.post(f"{url}/tokenize", json={"messages": messages, **extra}).json()
    assert tok["tokens"] == list(want.prompt_token_ids)
    for body in ({"continue_final_message": True}, {"chat_template_kwargs": {"continue_final_message": True}}):
        err = _err(httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, **body}), 400)
        assert "continue_final_message" in err["param"], err


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(url, client, offline):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens, on the server and offline alike; -1 fits a prompt
    longer than the context; bad values and combinations are 400s naming the field."""
    long_ids = list(offline.generate(["The quick brown fox jumps over the lazy dog. " * 20],
                                     SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids)
    assert len(long_ids) > 40
    want = offline.generate([long_ids[-8:]], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    got = offline.generate([long_ids], SamplingParams(temperature=0, max_tokens=10, truncate_prompt_tokens=8),
                           use_tqdm=False)[0]
    assert list(got.prompt_token_ids) == long_ids[-8:] and got.outputs[0].token_ids == want.outputs[0].token_ids
    r = client.completions.create(model=MODEL, prompt=long_ids, max_tokens=10, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 8})
    assert r.choices[0].text == want.outputs[0].text and r.usage.prompt_tokens == 8
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 40}], max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": 6})
    assert r.usage.prompt_tokens == 6
    too_long = long_ids * (MAX_LEN // len(long_ids) + 1)
    r = client.completions.create(model=MODEL, prompt=too_long, max_tokens=4, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == MAX_LEN - 1 and r.usage.completion_tokens == 1
    for extra, param in (({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                         ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
                         ({"truncate_prompt_tokens": MAX_LEN}, "truncate_prompt_tokens"),
                         ({"truncate_prompt_tokens": 4, "echo": True}, "echo")):
        err = _err(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", **extra}), 400)
        assert err["param"] == param, (extra, err)


def test_streaming_equals_plain(client):
    for prompt in PROMPTS[:2]:
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
        assert chunks[-1].model_extra["spec_decode"]["drafted"] > 0

    messages = [{"role": "user", "content": "Hello there"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert "spec_decode" in chunks[-1].model_extra


def test_usage_streams_only_when_asked(url):
    """OpenAI and vLLM send the usage chunk only with stream_options.include_usage; stream_options without
    stream is a 400 (vLLM)."""
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        body = {"model": MODEL, "max_tokens": 5, **body}
        with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=30) as resp:
            events = sse_events(resp)
        assert events[-1] == "[DONE]"
        assert not any("usage" in e or "spec_decode" in e for e in events[:-1]), events[-2]
        assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        err = _err(httpx.post(f"{url}{path}", json={**body, "stream_options": {"include_usage": True}}), 400)
        assert err["param"] == "stream_options"


def test_sse_wire_format(url):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 5 and events[-2]["choices"] == []
    assert all(e["object"] == "text_completion" for e in events[:-1])


def test_n2_and_seed(client):
    r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, n=2, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(len(c.text) > 0 and c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 24
    again = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, n=2, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded sampling reproduces
    # two prompts x n=2: indices prompt*n + i
    r = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=4, n=2, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=10, n=2, temperature=0.8, seed=3, stream=True,
                                                 stream_options={"include_usage": True}))
    texts, finished = {0: "", 1: ""}, set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    assert chunks[-1].usage.completion_tokens > 0
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=10, n=2, temperature=0.8, seed=3)
    assert [texts[0], texts[1]] == [c.message.content for c in plain.choices]


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The quick", max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and 1 <= len(top) <= 4  # partial-UTF-8 tokens may share the string "\ufffd"
        assert abs(max(top.values()) - val) < 1e-5  # greedy: the chosen token is the most likely one

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert abs(item.top_logprobs[0].logprob - item.logprob) < 1e-5
        assert item.bytes == list(item.token.encode())
    # streamed logprobs add up to the same entries
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                                 stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [(x.token, round(x.logprob, 4)) for x in streamed] == [(x.token, round(x.logprob, 4)) for x in content]


def test_echo_with_logprobs_scores_the_prompt(client, offline):
    """lm-eval's loglikelihood request: echo, logprobs and max_tokens 0 give the prompt back with a logprob per
    token (the first has none) and generate nothing; with max_tokens the completion's entries follow. The
    values are the offline prompt_logprobs'; streamed, the echo chunk carries them."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ref = offline.generate([prompt], SamplingParams(prompt_logprobs=2, max_tokens=1, temperature=0),
                           use_tqdm=False)[0]
    n = len(ref.prompt_token_ids)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and "".join(lp.tokens) == prompt
    want = [d[t].logprob for t, d in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    # with a completion after the prompt
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.usage.completion_tokens == 3 and len(lp.tokens) == n + 3
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-5)
    assert r.choices[0].text.startswith(prompt) and lp.text_offset[n] == len(prompt)
    # streamed: the echo (with the prompt's logprobs) first, then nothing for max_tokens 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2,
                                            temperature=0, stream=True))
    texts = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert texts == prompt and chunks[-1].choices[0].finish_reason == "length"
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(want, abs=1e-5)
    # lm-eval's local-completions loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 1; it reads
    # the continuation's entries as token_logprobs[len(context):-1]
    ids = ref.prompt_token_ids
    r = httpx.post(f"{client.base_url}completions", json={"model": MODEL, "prompt": [ids, ids[:5]], "echo": True,
                                                            "logprobs": 1, "max_tokens": 1, "temperature": 0,
                                                            "seed": 1234}, timeout=60).json()
    full, short = sorted(r["choices"], key=lambda c: c["index"])
    assert len(full["logprobs"]["token_logprobs"]) == n + 1 and len(short["logprobs"]["token_logprobs"]) == 6
    assert full["logprobs"]["token_logprobs"][3:-1] == pytest.approx(want[2:], abs=1e-5)
    assert short["logprobs"]["token_logprobs"][1:5] == pytest.approx(want[:4], abs=1e-5)


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 12
    stop = base[8:11]
    want = base[:base.find(stop)]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40, temperature=0,
                                            stop=stop, stream=True, extra_body={"ignore_eos": True}))
    # the stream never leaks a partial stop string that the final text drops
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


# ---------------------------------------------------------------- continuous batching
def test_concurrent_streams_match_alone_and_metrics_add_up(url, client):
    jobs = [(f"{PROMPTS[i % 4]} {'and more ' * (i % 5)}#{i}", 6 + 5 * (i % 7)) for i in range(16)]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=m, temperature=0).choices[0].text
             for p, m in jobs]
    before = scrape(url)

    def run(job):
        p, m = job
        text, usage, spec, finish = "", None, None, None
        for c in client.completions.create(model=MODEL, prompt=p, max_tokens=m, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
            if c.choices:
                text += c.choices[0].text
                finish = c.choices[0].finish_reason or finish
            if c.usage is not None:
                usage, spec = c.usage, c.model_extra["spec_decode"]
        return text, usage, spec, finish

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    after = scrape(url)

    assert len(results) == 16
    for (text, usage, spec, finish), want in zip(results, alone):
        assert finish in ("stop", "length") and usage is not None
        assert text == want
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert d['specdecode:request_success_total{finished_reason="stop"}'] + \
        d['specdecode:request_success_total{finished_reason="length"}'] == 16
    assert d['specdecode:request_success_total{finished_reason="abort"}'] == 0
    assert d["specdecode:prompt_tokens_total"] == sum(r[1].prompt_tokens for r in results)
    assert d["specdecode:generation_tokens_total"] == sum(r[1].completion_tokens for r in results)
    assert d["specdecode:spec_decode_num_drafts_total"] == sum(r[2]["drafts"] for r in results)
    assert d["specdecode:spec_decode_num_draft_tokens_total"] == sum(r[2]["drafted"] for r in results)
    assert d["specdecode:spec_decode_num_accepted_tokens_total"] == sum(r[2]["accepted"] for r in results)
    per_pos = sum(v for k, v in d.items() if k.startswith("specdecode:spec_decode_num_accepted_tokens_per_pos"))
    assert per_pos == d["specdecode:spec_decode_num_accepted_tokens_total"]
    assert d["specdecode:time_to_first_token_seconds_count"] == 16
    assert d["specdecode:e2e_request_latency_seconds_count"] == 16
    assert d["specdecode:inter_token_latency_seconds_count"] > 0
    assert after["specdecode:huge_pages_pending_bytes"] >= 0  # benchmarks wait for 0 (test_huge_pages)
    assert after["specdecode:num_requests_running"] == 0
    # vLLM's names carry the same values, so a dashboard built for vLLM reads this server unchanged.
    ours = {k.removeprefix("specdecode:"): v for k, v in after.items() if k.startswith("specdecode:")}
    theirs = {k.removeprefix("vllm:"): v for k, v in after.items() if k.startswith("vllm:")}
    assert theirs == {k: v for k, v in ours.items() if not k.startswith(("request_errors", "huge_pages"))}
    assert "num_requests_running" in theirs and "time_to_first_token_seconds_count" in theirs


def test_client_disconnect_aborts_and_others_continue(url, client):
    before = scrape(url)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_LEN - 20, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=40,
                                                              temperature=0, extra_body={"ignore_eos": True}))
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", f"{url}/v1/completions", json=body) as resp:
                first = next(line for line in resp.iter_lines() if line.startswith("data: "))
                assert json.loads(first[6:])["choices"]
            # leaving the block closes the connection mid-stream
        assert other.result(timeout=60).usage.completion_tokens == 40
    key = 'specdecode:request_success_total{finished_reason="abort"}'
    deadline = time.time() + 20
    while True:
        m = scrape(url)
        if m[key] - before.get(key, 0) >= 1 and m["specdecode:num_requests_running"] == 0:
            break
        assert time.time() < deadline, "the disconnected request was not aborted"
        time.sleep(0.1)
    assert m[key] - before.get(key, 0) == 1
    # a plain (non-streaming) request whose client gives up is aborted too. The client hangs up as soon as the
    # server runs the request (not after a fixed wait, which a slow machine may spend connecting and a fast one
    # generating all 492 tokens), and no answer has come by then.
    plain = json.dumps({**body, "stream": False}).encode()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(plain), plain))
        while scrape(url)["specdecode:num_requests_running"] < 1:
            assert time.time() < deadline + 20, "the plain request did not start"
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing to read: the request was still running
            sock.recv(1)
    while scrape(url)[key] - before.get(key, 0) < 2:
        assert time.time() < deadline + 20, "the timed-out request was not aborted"
        time.sleep(0.1)
    # its slot is free again: the server still serves
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    assert r.usage.completion_tokens >= 1


# ---------------------------------------------------------------- errors
def _err(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "n": "many"}, "n"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
])
def test_invalid_params_400(url, path, body, param):
    err = _err(httpx.post(f"{url}{path}", json={"model": MODEL, **body}), 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param or (err["param"] or "").startswith(param), err


C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
SCHEMA_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path,body,param", [
    # the field is named exactly, never a word of the message ("Invalid", "Give")
    (CH, {"messages": MSG, "guided_choice": []}, "guided_choice"),
    (CH, {"messages": MSG, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    (CH, {"messages": MSG, "guided_json": {"type": "object"}, "response_format": {"type": "json_object"}},
     "guided_json"),
    (CH, {"messages": MSG, "tool_choice": "required", "tools": [
        SCHEMA_TOOL, {"type": "function", "function": {"name": "g", "parameters": {"type": "nonsense"}}}]},
     "tools.1.function.parameters"),
    (CH, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
    (CH, {"messages": MSG, "guided_regex": "(ab"}, "guided_regex"),
    (CH, {"messages": MSG, "guided_grammar": 'root ::= "a" | ('}, "guided_grammar"),
    (C, {"prompt": [999999999]}, "prompt"),
    (C, {"prompt": [-1]}, "prompt"),
    (C, {"prompt": "x", "temperature": -1}, "temperature"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.image_url"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0.type"),
    # a text part without its text, unknown roles, missing content
    (CH, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text"),
    (CH, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    (CH, {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user"}]}, "messages.1.content"),
    (CH, {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    (CH, {"messages": MSG + [{"role": "assistant", "content": None}]}, "messages.1.content"),
    # assistant tool_calls arguments: a JSON object in a string
    (CH, {"messages": MSG + [{"role": "assistant", "tool_calls": [
        CALL, {**CALL, "function": {"name": "f", "arguments": "{city: Paris"}}]}]},
     "messages.1.tool_calls.1.function.arguments"),
    (CH, {"messages": MSG + [{"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "f", "arguments": '["Paris"]'}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    # token ids outside the vocabulary, wherever they are given
    (CH, {"messages": MSG, "stop_token_ids": [99999999]}, "stop_token_ids"),
    (C, {"prompt": "x", "stop_token_ids": [5, 512]}, "stop_token_ids"),
    (C, {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    (C, {"prompt": "x", "logit_bias": {"99999999": 5}}, "logit_bias"),
    (C, {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo (scoring the prompt)
])
def test_error_param_names_the_field(url, path, body, param):
    err = _err(httpx.post(f"{url}{path}", json={"model": MODEL, "max_tokens": 2, **body}), 400)
    assert err["param"] == param, err
    assert "/project/cpp" not in err["message"] and not re.search(r"\[\d\d:\d\d:\d\d\]", err["message"]), err


def test_error_messages_read_right(url):
    err = _err(httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text"}]}]}), 400)
    assert "'text' field" in err["message"] and "Only text content parts" not in err["message"], err
    err = _err(httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MSG,
                                                               "guided_grammar": 'root ::= "a" | ('}), 400)
    assert err["message"].startswith("Invalid grammar constraint: EBNF parser error at line 1"), err
    # what stays valid: an assistant message with tool_calls and no content, the developer role (as system)
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "developer", "content": "Be brief."}, *MSG,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assert r.status_code == 200, r.text


def test_malformed_json_and_too_long_prompt(url, client):
    _err(httpx.post(f"{url}/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}),
         400, "invalid_json")
    _err(httpx.post(f"{url}/v1/chat/completions", content=b"not json", headers={"content-type": "application/json"}),
         400, "invalid_json")
    err = _err(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [5] * (MAX_LEN + 10)}), 400,
               "context_length_exceeded")
    assert str(MAX_LEN) in err["message"]
    _err(httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "fox " * (MAX_LEN * 2)}]}), 400, "context_length_exceeded")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[5] * (MAX_LEN + 10), stream=True)


def test_unknown_model_and_route_404(url, client):
    _err(httpx.post(f"{url}/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    _err(httpx.get(f"{url}/v1/nothing-here"), 404)
    _err(httpx.get(f"{url}/v1/completions"), 405)


def test_api_key_and_queue_full(engine_kwargs):
    kw = dict(engine_kwargs, max_num_seqs=1, max_waiting_requests=1)
    with serve(build_app(kw, MODEL, "sekret")) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            _err(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers), 401,
                 "invalid_api_key")
        _err(httpx.get(f"{url}/v1/models"), 401)
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            _err(httpx.post(f"{url}{path}", json=body), 401)
            assert httpx.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        # the key check comes first, whatever the body
        _err(httpx.post(f"{url}/v1/completions", content=b"{", headers={"content-type": "application/json"}), 401)
        assert httpx.get(f"{url}/health").status_code == 200 and httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.head(f"{url}/health").status_code == 200  # load balancers probe with HEAD too
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="bad", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0, timeout=60)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens >= 1

        # one slot and a waiting queue of one: a long stream runs, a second request waits, a third gets 503
        auth = {"Authorization": "Bearer sekret"}
        long_body = {"model": MODEL, "prompt": "Once", "max_tokens": MAX_LEN - 10, "stream": True,
                     "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=60, headers=auth) as h:
            with h.stream("POST", f"{url}/v1/completions", json=long_body) as running:
                assert running.status_code == 200, running.read()
                lines = running.iter_lines()
                next(lines)
                waiting = pool.submit(good.completions.create, model=MODEL, prompt="y", max_tokens=3)
                deadline = time.time() + 10
                while scrape(url)["specdecode:num_requests_waiting"] < 1:
                    assert time.time() < deadline
                    time.sleep(0.02)
                full = h.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "z"})
                _err(full, 503, "queue_full")
                assert int(full.headers["retry-after"]) >= 1
                with pytest.raises(openai.InternalServerError) as e:
                    good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "z"}])
                assert e.value.status_code == 503
            assert waiting.result(timeout=60).usage.completion_tokens == 3  # the aborted stream freed the slot
        m = scrape(url)
        assert m['specdecode:request_errors_total{status="503"}'] == 2
        assert m['specdecode:request_errors_total{status="401"}'] >= 5


# ---------------------------------------------------------------- the real process
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "specdecode.entrypoints.openai.api_server", *args]


def test_bad_startup_exits_2_with_one_line(tiny_models, tmp_path, capsys):
    from specdecode.entrypoints.openai.api_server import main

    # the real process, once: no traceback, one line, exit code 2
    p = subprocess.run(_server_cmd("--model", str(tmp_path / "missing")), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "error" in lines[0] and "missing" in lines[0], p.stderr
    # the same entry point in-process for the other bad settings
    for args in (["--model", str(tiny_models["llama"]), "--speculative-config", "{not json"],
                 ["--model", str(tiny_models["llama"]), "--speculative-model", "[ngram]",
                  "--num-speculative-tokens", "0"],
                 ["--model", str(tiny_models["llama"]), "--max-num-seqs", "0"],
                 ["--model", str(tiny_models["llama"]), "--speculative-model", str(tiny_models["llama"]),
                  "--num-speculative-tokens", "2", "--speculative-token-map", str(tmp_path / "no-map.json")],
                 ["--model", str(tiny_models["llama"]), "--no-such-flag"],
                 ["--model", str(tiny_models["llama"]), "--port", "99999"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and "error" in err[0] and "Traceback" not in err[0], (args, err)


def test_bad_port_and_context_fail_before_the_models_load(tiny_models, capsys):
    """`specdecode serve` checks --port while parsing (exiting later, while a loader thread runs, aborted the
    process), refuses a --max-model-len beyond the model's context and says what to lower when the KV cache
    does not fit: one line each, exit code 2."""
    from specdecode.entrypoints.cli import main

    for port in ("99999", "-1"):  # the real command, the default models: no SIGABRT
        p = subprocess.run([sys.executable, "-m", "specdecode", "serve", "--port", port], capture_output=True,
                           text=True, timeout=120)
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stderr)
        assert "--port" in lines[0] and "0..65535" in lines[0] and "terminate" not in p.stderr
    llama = str(tiny_models["llama"])  # max_position_embeddings 1024
    for args, fragments in ((["--max-model-len", "2048"], ("2048", "1024")),
                            (["--max-num-seqs", str(10 ** 10)], ("KV cache", "does not fit", "--max-num-seqs"))):
        with pytest.raises(SystemExit) as e:
            main(["serve", llama, "--speculative-model", "[ngram]", "--port", "0", *args])
        assert e.value.code == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and "Traceback" not in err[0] and "Errno" not in err[0], err
        assert all(f in err[0] for f in fragments), err


def test_sigterm_graceful_shutdown(tiny_models):
    port = _free_port()
    proc = subprocess.Popen(_server_cmd("--model", str(tiny_models["llama"]), "--speculative-model", "[ngram]",
                                        "--num-speculative-tokens", "3", "--port", str(port), "--max-model-len",
                                        str(MAX_LEN), "--served-model-name", MODEL, "--max-num-seqs", "2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert time.time() < deadline
            time.sleep(0.1)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 120, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        events = [json.loads(x[6:]) for x in [first] + rest if x != "data: [DONE]"]
        # the in-flight request either finished or got an error event; either way the stream ended cleanly
        assert rest[-1] == "data: [DONE]"
        assert "error" in events[-1] or events[-1]["choices"][-1]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
        with socket.socket() as s:  # the port is released
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_metrics_carry_vllms_spec_decode_names(url, client):
    """/metrics exposes vLLM's vllm:spec_decode_* counters (so vLLM dashboards work), equal to the
    specdecode: ones, and they move with a request's drafts."""
    before = scrape(url)
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = scrape(url)
    assert r.usage.completion_tokens == 24
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        ours, vllm = f"specdecode:spec_decode_{name}_total", f"vllm:spec_decode_{name}_total"
        assert after[vllm] == after[ours]
        assert after[vllm] - before.get(vllm, 0) == after[ours] - before.get(ours, 0)
    assert after["vllm:spec_decode_num_drafts_total"] > before.get("vllm:spec_decode_num_drafts_total", 0)
    per_pos = {k: v for k, v in after.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos")}
    assert per_pos and all('position="' in k for k in per_pos)
    assert sum(per_pos.values()) == after["vllm:spec_decode_num_accepted_tokens_total"]
    for k, v in per_pos.items():
        assert after[k.replace("vllm:", "specdecode:", 1)] == v


def test_tokenize_and_detokenize_give_the_ids_a_request_feeds_the_model(url, client):
    """vLLM's /tokenize and /detokenize: a prompt's count is a completion's usage.prompt_tokens, and messages'
    count is a chat completion's; detokenize inverts tokenize; bad bodies are 400s that name the field."""
    prompt = "The quick brown fox"
    got = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert got["count"] == len(got["tokens"]) == done.usage.prompt_tokens and got["max_model_len"] == MAX_LEN
    assert len(got["token_strs"]) == got["count"] and "".join(got["token_strs"]).replace("\u0120", " ") == prompt
    assert httpx.post(f"{url}/detokenize", json={"tokens": got["tokens"]}).json() == {"prompt": prompt}

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat["count"] == answer.usage.prompt_tokens and "token_strs" not in chat
    bare = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][:bare["count"]] and bare["count"] < chat["count"]

    for path, body, param in (("/tokenize", {"prompt": prompt, "messages": messages}, "prompt"),
                              ("/tokenize", {"prompt": prompt, "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
                              ("/tokenize", {"prompt": prompt, "model": "other"}, "model"),
                              ("/detokenize", {"tokens": [1, 10 ** 6]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")):
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(f"{url}/tokenize", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/tokenize", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_echo_of_token_ids_outside_the_vocabulary_is_a_400_and_the_connection_lives(url):
    """echo decodes the prompt's ids: they are checked first, so a bad id is the same 400 as without echo (it
    was a 500 that closed the client's keep-alive connection)."""
    with httpx.Client(timeout=60) as h:
        for prompt in ([-1], [[-3]], [10 ** 30], [1, 2, 10 ** 6]):
            err = _err(h.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "echo": True,
                                                              "max_tokens": 1}), 400)
            assert err["param"] == "prompt" and "must be in [0," in err["message"], err
        ok = h.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [5, 6], "echo": True, "max_tokens": 1})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


@pytest.mark.parametrize("flag,value", [("--max-request-body-bytes", "-1"), ("--max-request-body-bytes", "0"),
                                        ("--limit-concurrency", "-1"), ("--request-body-timeout", "nan"),
                                        ("--request-body-timeout", "-5"), ("--timeout-graceful-shutdown", "inf"),
                                        ("--timeout-graceful-shutdown", "-1"), ("--num-replicas", "0")])
def test_server_limits_that_would_refuse_every_request_are_refused_at_start(flag, value, capsys):
    from specdecode.entrypoints.cli import main

    assert main(["serve", flag, value]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and flag in err[0] and value in err[0], err


def test_prompts_times_n_beyond_the_waiting_limit_is_a_400_not_retry_later(url):
    """The server's waiting limit is 64: 5 prompts x n=16 could start only on an idle server, so they are refused
    for good (a 503 would have the client retry forever); 4 x 16 runs."""
    body = {"model": MODEL, "prompt": [[1, 2]] * 5, "n": 16, "max_tokens": 1}
    err = _err(httpx.post(f"{url}/v1/completions", json=body, timeout=60), 400)
    assert err["param"] == "prompt" and "80 sequences" in err["message"], err
    ok = httpx.post(f"{url}/v1/completions", json=dict(body, prompt=[[1, 2]] * 4), timeout=120)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 64


def test_token_id_prompts_take_integers_only_and_stop_strings_are_bounded(url):
    """A prompt of ids is integers, strictly: true/false and 1.5 are 400s naming the prompt (true was read as
    id 1), and a list of digit strings is a list of text prompts."""
    for prompt in ([True, False], [1.5, 2], [[1, True]]):
        err = _err(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}),
                   400)
        assert err["param"].startswith("prompt"), err
    ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": ["1", "2"], "max_tokens": 1}).json()
    assert len(ok["choices"]) == 2 and ok["usage"]["prompt_tokens"] == 2

    # every stop string is searched for after each step on the engine thread: a bounded number of them
    err = _err(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                          "stop": [f"s{i}" for i in range(257)]}), 400)
    assert err["param"] == "stop" and "at most 256" in err["message"], err
