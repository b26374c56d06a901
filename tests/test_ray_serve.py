"""The Ray Serve scale-out (specdecode.entrypoints.ray), end to end: a local Ray instance, 2 engine replicas of a tiny
model with n-gram speculation behind one HTTP port, checked against the single-process server run in this process.

One Ray instance and one deployment serve every check (Ray's start-up is most of the cost); the last test shuts
it down and checks that the port and the processes are released."""
from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import time
import warnings
from types import SimpleNamespace

import httpx
import openai
import psutil
import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
with warnings.catch_warnings():  # Ray Serve's pydantic models warn about pydantic 2 deprecations on import
    warnings.simplefilter("ignore", DeprecationWarning)
    from ray import serve  # noqa: E402

    from specdecode.entrypoints.ray.serve import (REPLICA_HEADER, app_builder, build_app, routing_text,  # noqa: E402
                                                  serve_from_args)
    from specdecode.entrypoints.ray.deployments import _METRICS_PUSH_S  # noqa: E402
from specdecode.entrypoints.openai.api_server import build_app as build_single_app  # noqa: E402
from test_server import serve as serve_in_thread  # noqa: E402

MODEL = "tiny-llama"
APP = "specdecode"
MAX_LEN = 1024
PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "Speculative decoding drafts"]
# ~150 tokens shared by every request of the affinity checks
SHARED = ("You are a careful assistant. " + "The quick brown fox jumps over the lazy dog. " * 12
          + "def add(a, b):\n    return a + b\n" * 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    """A new server can listen on the port (as servers do, with SO_REUSEADDR: closed connections of the old
    one may linger in TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


def _ray_processes() -> list[psutil.Process]:
    """Ray's daemons and workers started by this test process (all are its descendants)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "ray" in cmd and p.status() != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


@pytest.fixture(scope="module")
def engine_kwargs(tiny_models):
    return {"model": str(tiny_models["llama"]), "max_model_len": MAX_LEN, "max_num_seqs": 4,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}}


@pytest.fixture(scope="module")
def single_url(engine_kwargs):
    """The single-process server (also builds the CPU kernels before any replica needs them)."""
    with serve_in_thread(build_single_app(engine_kwargs, MODEL, None)) as url:
        # one request builds the CPU kernels here, before the replicas load them (a process killed while
        # building would leave the build lock behind)
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=600).is_success
        yield url


class RayApp:
    def __init__(self, url: str, port: int):
        self.url, self.port = url, port
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            try:
                serve.shutdown()
            finally:
                ray.shutdown()


def _start_ray() -> None:
    # Ray gives its daemons a fixed 30 s to register; on a machine loaded far beyond its cores that can run out
    for attempt in range(2):
        try:
            ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
            return
        except Exception:
            if attempt:
                raise
            ray.shutdown()
            for p in _ray_processes():
                p.kill()


@pytest.fixture(scope="module")
def ray_app(engine_kwargs, single_url):
    _start_ray()
    port = _free_port()
    app = RayApp(f"http://127.0.0.1:{port}", port)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(engine_kwargs, num_replicas=2, ray_actor_options={"num_cpus": 1},
                            served_model_name=MODEL), name=APP, route_prefix="/")
        yield app
    finally:
        app.stop()


@pytest.fixture(scope="module")
def ray_client(ray_app):
    return openai.OpenAI(base_url=f"{ray_app.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def single_client(single_url):
    return openai.OpenAI(base_url=f"{single_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _replica_of(client: openai.OpenAI, **kw) -> tuple[str, object]:
    raw = client.completions.with_raw_response.create(model=MODEL, temperature=0, **kw)
    return raw.headers[REPLICA_HEADER], raw.parse()


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_metric(url: str, name: str, want: float, timeout: float = 20.0) -> float:
    deadline = time.time() + timeout
    got = _metric(url, name)
    while got != want and time.time() < deadline:
        time.sleep(0.25)
        got = _metric(url, name)
    return got


def _settled_metric(url: str, name: str, timeout: float = 60.0) -> float:
    """The metric once it has stopped changing for three of the replicas' push intervals: with no request in
    flight, every replica's counters are final, and each push carries a whole snapshot of them."""
    quiet = 3 * _METRICS_PUSH_S + 0.5
    deadline = time.time() + timeout
    got, since = _metric(url, name), time.time()
    while time.time() - since < quiet:
        assert time.time() < deadline, f"{name} kept changing"
        time.sleep(0.25)
        now = _metric(url, name)
        if now != got:
            got, since = now, time.time()
    return got


# ---------------------------------------------------------------- builders and command line (no Ray start)
def test_builders_check_settings_first(engine_kwargs, monkeypatch, capsys):
    spec = json.dumps(engine_kwargs["speculative_config"])
    app = app_builder({"model": engine_kwargs["model"], "num_replicas": "2", "num_cpus": "1",
                       "speculative_config": spec})  # serve run's key=value strings
    assert isinstance(app, serve.Application)
    with pytest.raises(ValueError, match="num_replicas"):
        app_builder({"model": engine_kwargs["model"], "num_replicas": "0"})
    with pytest.raises(ValueError, match="max_num_seqs"):
        build_app({**engine_kwargs, "max_num_seqs": 0})
    with pytest.raises(ValueError, match="request_router"):
        build_app(engine_kwargs, request_router="fastest")
    # specdecode serve --ray: bad settings are one line and exit code 2, before any Ray process starts
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = SimpleNamespace(host="127.0.0.1", port=0, api_key=None, served_model_name=None, num_replicas=2)
    assert serve_from_args(args, {**engine_kwargs, "max_num_seqs": 0}) == 2
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args.port = busy.getsockname()[1]
        assert serve_from_args(args, engine_kwargs) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "max_num_seqs" in err[0] and "cannot listen" in err[1]
    assert all(line.startswith("specdecode serve: error: ") for line in err)
    assert not ray.is_initialized()


# ---------------------------------------------------------------- the same API as one process
def test_openai_client_same_greedy_output(ray_client, single_client):
    for prompt in PROMPTS:
        want = single_client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        got = ray_client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == want.choices[0].text
        assert got.usage == want.usage
        assert got.model_extra["spec_decode"]["drafted"] == want.model_extra["spec_decode"]["drafted"]
        chunks = list(ray_client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.choices[0].text
        assert chunks[-1].usage == want.usage
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    want = single_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    got = ray_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    chunks = list(ray_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                     stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content
    assert [m.id for m in ray_client.models.list().data] == [MODEL]


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}),
    ("POST", "/v1/completions", {"model": "nope", "prompt": "x"}),
    ("POST", "/v1/completions", {"model": MODEL}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}),
    ("POST", "/v1/completions", b"{not json"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x" * 8000, "max_tokens": 4}),
    ("GET", "/v1/nothing-here", None),
])
def test_bad_request_same_error(ray_app, single_url, method, path, body):
    def call(url):
        content = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        return httpx.request(method, url + path, content=content, timeout=60,
                             headers={"content-type": "application/json"})
    want, got = call(single_url), call(ray_app.url)
    assert 400 <= want.status_code < 500
    assert got.status_code == want.status_code
    assert got.json() == want.json()
    assert got.headers[REPLICA_HEADER]


# ---------------------------------------------------------------- prefix-aware routing
def test_routing_text():
    assert routing_text("/v1/completions", b'{"prompt": "abc"}') == "abc"
    assert routing_text("/v1/completions", b'{"prompt": ["abc", "d"]}') == "abc"
    assert routing_text("/v1/completions", b'{"prompt": [1, 2]}') == "1 2"
    assert routing_text("/v1/models", b"") is None
    assert routing_text("/v1/completions", b"{bad") is None
    turn1 = [{"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "yo"}, {"role": "user", "content": [{"type": "text",
                                                                                           "text": "more"}]}]
    t1 = routing_text("/v1/chat/completions", json.dumps({"messages": turn1}).encode())
    t2 = routing_text("/v1/chat/completions", json.dumps({"messages": turn2}).encode())
    assert t2.startswith(t1) and t2.endswith("more\n")


def test_shared_prefix_lands_on_one_replica(ray_client):
    seen = [_replica_of(ray_client, prompt=SHARED + f" Question {i}: why?", max_tokens=4)[0] for i in range(8)]
    assert len(set(seen)) == 1, seen
    # a multi-turn conversation follows its first turn
    messages = [{"role": "system", "content": SHARED}, {"role": "user", "content": "First question?"}]
    raw = ray_client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                               temperature=0)
    first = raw.headers[REPLICA_HEADER]
    for turn in range(3):
        messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content},
                     {"role": "user", "content": f"Follow-up {turn}?"}]
        raw = ray_client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=8,
                                                                   temperature=0)
        assert raw.headers[REPLICA_HEADER] == first


def test_unrelated_prompts_use_both_replicas(ray_client):
    seen = {_replica_of(ray_client, prompt=f"{i} " + "unrelated words " * (i % 5), max_tokens=2)[0]
            for i in range(24)}
    assert len(seen) == 2


def test_busy_owner_spills_to_the_other_replica(ray_app):
    """More concurrent requests with one prefix than the owner holds (max_ongoing_requests = max_num_seqs = 4):
    the rest go to the other replica instead of queueing behind the owner."""
    # long enough that all eight overlap even when the machine is loaded (a CI worker beside this one): a
    # request that ends before the fifth one is routed frees its slot at the owner and nothing spills
    body = {"model": MODEL, "prompt": SHARED + " Spill?", "max_tokens": 384, "temperature": 0,
            "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda _: httpx.post(f"{ray_app.url}/v1/completions", json=body, timeout=120), range(8)))
    assert all(r.status_code == 200 for r in rs)
    assert len({r.headers[REPLICA_HEADER] for r in rs}) == 2
    assert len({r.json()["choices"][0]["text"] for r in rs}) == 1  # greedy: same text wherever it ran


# ---------------------------------------------------------------- metrics
def test_metrics_sum_the_replicas(ray_app, ray_client, single_url):
    assert _wait_metric(ray_app.url, "specdecode:ray_replicas_reporting", 2) == 2
    name = "specdecode:spec_decode_num_draft_tokens_total"
    before = _settled_metric(ray_app.url, name)  # earlier requests' counters have all been pushed
    drafted, replicas = 0, set()
    for i in range(16):  # short prompts: power of two choices, so both replicas serve some
        rid, r = _replica_of(ray_client, prompt=f"{i} abc abc abc abc abc abc", max_tokens=16)
        drafted += r.model_extra["spec_decode"]["drafted"]
        replicas.add(rid)
    assert drafted > 0 and len(replicas) == 2
    assert _wait_metric(ray_app.url, name, before + drafted) == before + drafted
    # the same series as the single-process server, plus the app's own two
    def series(url):
        return {re.sub(r'="[^"]*"', "", line.rsplit(" ", 1)[0]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                if line and not line.startswith("#")}
    ray_series = series(ray_app.url)
    assert series(single_url) <= ray_series
    assert ray_series - series(single_url) == {"specdecode:ray_replicas_reporting",
                                               "specdecode:ray_replica_failures_total"}


# ---------------------------------------------------------------- faults
def test_replica_killed_mid_stream(ray_app, ray_client):
    counter = "specdecode:generation_tokens_total"
    tokens_before = _settled_metric(ray_app.url, counter)
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": MAX_LEN - 16, "ignore_eos": True,
            "temperature": 0, "stream": True}
    events = []
    t0 = time.time()
    with httpx.stream("POST", f"{ray_app.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        victim = resp.headers[REPLICA_HEADER]
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[6:])
                break
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#EngineReplica#{victim}", namespace="serve"))
        events += [line[6:] for line in lines if line.startswith("data: ")]
    assert time.time() - t0 < 30
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])
    assert err["error"]["code"] == "replica_died" and err["error"]["type"] == "server_error"
    assert not any(json.loads(e).get("choices", [{}])[0].get("finish_reason") for e in events[:-2])
    # new requests go to the survivor at once
    for i in range(3):
        rid, r = _replica_of(ray_client, prompt=f"after the crash {i}", max_tokens=8)
        assert rid != victim and r.choices[0].text
    # Ray starts a replacement; the dead replica's counters stay in the sums
    deadline = time.time() + 180
    while True:
        running = serve.status().applications[APP].deployments["EngineReplica"].replica_states.get("RUNNING", 0)
        if running == 2 or time.time() > deadline:
            break
        time.sleep(1)
    assert running == 2
    assert _metric(ray_app.url, counter) >= tokens_before
    seen: set[str] = set()  # the ingress hears of the new replica a moment after it runs
    for i in range(400):
        seen.add(_replica_of(ray_client, prompt=f"{i} " + "fresh words " * (i % 5), max_tokens=2)[0])
        if len(seen) == 2 or time.time() > deadline:
            break
        time.sleep(0.1)
    assert len(seen) == 2 and victim not in seen


def test_shutdown_releases_port_and_processes(ray_app):
    assert _ray_processes() and not _port_free(ray_app.port)
    ray_app.stop()
    deadline = time.time() + 30
    while (not _port_free(ray_app.port) or _ray_processes()) and time.time() < deadline:
        time.sleep(0.5)
    assert _port_free(ray_app.port)
    assert _ray_processes() == []
    assert not ray.is_initialized()
