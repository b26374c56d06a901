"""Predicted outputs (SamplingParams.prediction, OpenAI's ``prediction``): drafts from the expected text, the
output unchanged whatever the prediction says, and a clear refusal where speculation cannot use one."""
from __future__ import annotations

import json

import httpx
import pytest

from specdecode import SamplingParams
from specdecode.engine.llm_engine import LLMEngine
from specdecode.speculative.prediction import predicted, prediction_usage

MAX_LEN = 256


class _Req:
    def __init__(self, prompt: list[int], prediction: list[int] | None):
        self.prompt_token_ids, self.prediction_ids = prompt, prediction


def test_drafts_follow_the_prediction_and_pick_it_up_again_after_an_edit():
    pred = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12, 13, 14, 15, 16, 17]
    r = _Req([1, 2, 3], pred)
    assert predicted(r, [1, 2, 3], 4) == [10, 11, 12, 13]  # nothing out yet: the prediction's start
    assert predicted(r, [1, 2, 3, 10, 11], 3) == [12, 13, 14]  # still on it
    # Left it (99 replaced 12), then back on "13 14": of its two places in the prediction, the one nearest the
    # output's own length (position 4 rather than 12) is where the text goes on.
    assert predicted(r, [1, 2, 3, 10, 11, 99, 13, 14], 3) == [15, 16, 17]
    out = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12, 13, 99, 13, 14]
    assert predicted(r, [1, 2, 3] + out, 2) == [15, 16]  # nearest to position 15: the second repeat
    assert predicted(r, [1, 2, 3] + pred, 4) == []  # the output is the whole prediction: nothing left
    assert predicted(r, [1, 2, 3, 50, 51], 4) == []  # matches no part of it
    assert predicted(_Req([1], None), [1, 5], 4) == []


def test_prediction_usage_counts_the_predicted_tokens_the_output_kept():
    assert prediction_usage([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) == (5, 0)
    assert prediction_usage([1, 2, 3, 4, 5], [1, 2, 9, 9, 4, 5, 6]) == (4, 1)  # 3 was replaced
    assert prediction_usage([7, 7, 7, 7], [7, 7]) == (2, 2)
    assert prediction_usage([1, 2], []) == (0, 2)


@pytest.fixture(scope="module")
def smollm2() -> str:
    """A real model (SmolLM2-135M): its text decodes and re-encodes to the same tokens, as a prediction must."""
    from test_gguf_loader import smollm2_path

    return str(smollm2_path())


@pytest.fixture(scope="module")
def engine(smollm2):
    return LLMEngine.from_kwargs(model=smollm2, max_model_len=MAX_LEN, num_threads=1,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 8})


def _generate(engine: LLMEngine, params: SamplingParams) -> tuple[list[int], int]:
    """The output's token ids and the number of engine steps it took."""
    engine.add_request("r", "Write a short story about a cat.", params)
    out, steps = None, 0
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            out = o
    return list(out.outputs[0].token_ids), steps


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 3)])
def test_the_output_is_the_same_with_any_prediction_and_a_good_one_saves_passes(engine, temperature, seed):
    # Greedy and seeded sampling are verified by the argmax of their rows, so any drafts give the same output.
    params = SamplingParams(max_tokens=64, temperature=temperature, seed=seed, ignore_eos=True)
    plain, plain_steps = _generate(engine, params)
    text = engine.tokenizer.decode(plain)
    exact, steps = _generate(engine, params.clone(prediction=text))
    assert exact == plain
    assert plain_steps > 40 and steps <= 10, (plain_steps, steps)  # 8 tokens drafted a step, all accepted
    # An edit halfway: the drafts leave the prediction there and pick it up again after it.
    edited = text[: len(text) // 2] + " and then something else entirely, " + text[len(text) // 2:]
    out, edited_steps = _generate(engine, params.clone(prediction=edited))
    assert out == plain and edited_steps <= 14, edited_steps
    assert _generate(engine, params.clone(prediction="unrelated words, nothing alike"))[0] == plain


def test_a_prediction_without_lookup_drafting_is_refused(tiny_models, tiny_draft):
    for spec in ({"method": "none"}, {"method": "draft_model", "model": str(tiny_draft), "num_speculative_tokens": 2}):
        eng = LLMEngine.from_kwargs(model=str(tiny_models["llama"]), max_model_len=MAX_LEN, num_threads=1,
                                    speculative_config=spec)
        with pytest.raises(ValueError, match="prediction needs a speculative method that drafts by lookup"):
            eng.add_request("r", "hi", SamplingParams(max_tokens=4, prediction="hello"))
        assert not eng.has_unfinished_requests()
    with pytest.raises(ValueError, match="prediction must be a string"):
        SamplingParams(prediction=["hello"])


def test_server_refuses_a_prediction_it_cannot_use(tiny_models):
    from test_server import serve

    from specdecode.entrypoints.openai.api_server import build_app

    app = build_app({"model": str(tiny_models["llama"]), "speculative_config": {"method": "none"},
                     "max_model_len": MAX_LEN, "num_threads": 1}, "tiny", None)
    with serve(app) as url:
        for stream in (False, True):
            r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                           json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                 "stream": stream, "prediction": {"type": "content", "content": "hello"}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prediction", r.text


def test_server_takes_openai_prediction(smollm2):
    import openai
    from test_server import serve

    from specdecode.entrypoints.openai.api_server import build_app

    app = build_app({"model": smollm2, "speculative_model": "[ngram]", "num_speculative_tokens": 8,
                     "max_model_len": MAX_LEN, "num_threads": 1}, "tiny", None)
    stats = app.state.engine.engine.spec_stats
    with serve(app) as url, httpx.Client(base_url=url, timeout=120) as h:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 48,
                "temperature": 0, "ignore_eos": True}
        text = h.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        for prediction in ({"type": "content", "content": text},
                           {"type": "content", "content": [{"type": "text", "text": text[:20]},
                                                           {"type": "text", "text": text[20:]}]}):
            accepted = stats.num_accepted_tokens
            r = client.chat.completions.create(model="tiny", messages=body["messages"], max_tokens=48, temperature=0,
                                               prediction=prediction, extra_body={"ignore_eos": True})
            assert r.choices[0].message.content == text
            assert stats.num_accepted_tokens - accepted >= 40  # nearly all 48 tokens came from the prediction
            details = r.usage.completion_tokens_details
            assert details.accepted_prediction_tokens >= 44 and details.rejected_prediction_tokens <= 4, details
        assert h.post("/v1/chat/completions", json=body).json()["usage"].get("completion_tokens_details") is None
        two = h.post("/v1/chat/completions", json=dict(body, n=2, prediction={"type": "content", "content": text}))
        details = two.json()["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] >= 88, details  # both choices, each nearly all of 48
        stream = h.post("/v1/chat/completions", json=dict(body, stream=True, stream_options={"include_usage": True},
                                                          prediction={"type": "content", "content": text[:30]}))
        usage = [json.loads(line[6:]) for line in stream.text.splitlines()
                 if line.startswith("data: {") and '"usage"' in line][-1]["usage"]
        assert usage["completion_tokens_details"]["accepted_prediction_tokens"] > 0
        bad = h.post("/v1/chat/completions", json=dict(body, prediction={"type": "text", "content": text}))
        assert bad.status_code == 400 and "prediction" in bad.text, bad.text


def test_generate_takes_a_prediction_file(smollm2, tmp_path):
    from test_cli import assert_one_line_error, run_cli

    args = ["generate", "-m", smollm2, "--spec-type", "ngram", "--draft", 8, "--raw", "-p", "Once upon a time",
            "-n", 48, "--ignore-eos", "--json", "-t", 1]
    p = run_cli(*args)
    assert p.returncode == 0, p.stderr
    plain = json.loads(p.stdout)
    pred = tmp_path / "prediction.txt"
    pred.write_text(plain["text"], encoding="utf-8")
    p = run_cli(*args, "--prediction", pred)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["token_ids"] == plain["token_ids"]
    assert out["stats"]["n_accept"] >= 40 > plain["stats"]["n_accept"], (out["stats"], plain["stats"])
    assert_one_line_error(run_cli(*args, "--prediction", tmp_path / "missing.txt"), "cannot read prediction file")
    p = run_cli("generate", "-m", smollm2, "--spec-type", "none", "-p", "hi", "-n", 4, "--prediction", pred)
    assert_one_line_error(p, "prediction needs a speculative method that drafts by lookup")
