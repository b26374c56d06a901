"""The specdecode command line, run as a real subprocess on the tiny models."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specdecode.entrypoints.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    return dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")


def run_cli(*args, input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdecode", *map(str, args)], capture_output=True, text=True,
                          input=input, timeout=timeout, cwd=ROOT, env=_env())


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """In-process runs set torch's thread count (-t 1, fastest for tiny models); restore it afterwards."""
    import torch
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def assert_one_line_error(p: subprocess.CompletedProcess, *fragments: str) -> None:
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("error: "), p.stderr
    assert "Traceback" not in p.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_help_reads_well(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("generate", "chat", "bench", "serve", "examples:"):
        assert cmd in out
    for cmd, must in (("generate", ["-md DRAFT", "--draft K", "--json", "-n N"]),
                      ("chat", ["/exit", "Ctrl-C"]),
                      ("bench", ["--dataset", "--method", "--verify-cost", "--plot", "Spec-Bench"])):
        assert main([cmd, "--help"]) == 0
        out = capsys.readouterr().out
        for m in must:
            assert m in out, (cmd, m)


def test_generate_streams_text_and_prints_stats(tiny_models):
    p = run_cli("generate", "-m", tiny_models["llama"], "-md", "ngram", "-p", "The quick brown fox", "-n", 24,
                "--draft", 3, "-t", 1)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip(), "generated text goes to stdout"
    for key in ("n_draft   = 3", "n_predict = 24", "n_drafted =", "n_accept  =", "accept    =",
                "mean acceptance length =", "encoded", "decoded", "t/s", "load time ="):
        assert key in p.stderr, key
    assert "n_predict" not in p.stdout  # stats stay off stdout


def test_generate_json_with_draft_model(tiny_models, tiny_draft):
    p = run_cli("generate", "-m", tiny_models["llama"], "-md", tiny_draft, "-p", "Once upon a time", "-n", 12,
                "--draft", 2, "--json", "-t", 1)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["prompt"] == "Once upon a time"
    assert isinstance(d["text"], str) and len(d["token_ids"]) == 12
    s = d["stats"]
    assert s["n_draft"] == 2 and s["n_predict"] == 12
    assert s["n_drafted"] > 0 and 0 <= s["n_accept"] <= s["n_drafted"]
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["n_accept"] / s["n_drafts"])
    for key in ("accept_rate", "prompt_tokens_per_s", "decode_tokens_per_s", "load_time_s", "ttft_s"):
        assert key in s


def test_generate_with_deeper_lookups(tiny_models, tiny_draft):
    """--ngram-first --ngram-draft 8 with --draft 2: a repetitive prompt gets lookups deeper than the draft
    model's k, and the output equals plain decoding's."""
    prompt = "one two three four five six seven eight nine ten " * 6
    args = ["-m", tiny_models["llama"], "-p", prompt, "-n", 24, "--json", "-t", 1, "--ignore-eos"]
    plain = json.loads(run_cli("generate", *args, "-md", "none").stdout)
    p = run_cli("generate", *args, "-md", tiny_draft, "--draft", 2, "--ngram-first", "--ngram-min", 1,
                "--ngram-draft", 8)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["token_ids"] == plain["token_ids"]
    assert d["stats"]["n_drafted"] > 2 * d["stats"]["n_drafts"]  # more than the draft model's k per step


def test_missing_model_is_one_line_exit_2(tmp_path):
    p = run_cli("generate", "-m", tmp_path / "nope.gguf", "-p", "hi")
    assert_one_line_error(p, "nope.gguf")


def test_user_errors_are_one_line_exit_2(tiny_models, tmp_path, capsys):
    def check(argv, *fragments):
        assert main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
        for f in fragments:
            assert f in lines[0], lines[0]

    llama = tiny_models["llama"]
    check(["generate", "--draft", "0", "-p", "hi"], "--draft")                       # bad flag value
    check(["generate", "-m", llama, "--temp", "abc"], "--temp")
    check(["generate", "-m", llama, "--temp", "-1"], "--temp", "must be >= 0.0, got -1")
    check(["generate", "-m", llama, "--top-p", "0"], "--top-p", "must be in (0.0, 1.0], got 0")
    check(["generate", "-m", llama, "-p", "hi", "--max-model-len", "2048"], "--max-model-len 2048", "1024")
    check(["bench", "--dataset", tmp_path / "missing.jsonl"], "missing.jsonl")       # bad dataset path
    check(["bench", "--dataset", "humaneval", "--method", "foo"], "unknown method")
    check(["generate", "-m", llama, "-md", tmp_path / "no-draft"], "no-draft")       # missing draft
    check(["generate", "-m", llama, "-f", tmp_path / "no-prompt.txt"], "no-prompt.txt")
    check(["generate", "-m", llama, "-md", "ngram", "--ngram-draft", "8", "-p", "hi"], "--ngram-draft", "--ngram-first")
    check(["generate", "-m", llama, "--ngram-first", "--ngram-draft", "17", "-p", "hi"], "--ngram-draft", "1..16")
    # a ValueError raised by the engine (here: the prompt does not fit the context) is a user error too
    check(["generate", "-m", llama, "-md", "none", "-t", 1, "--max-model-len", "8", "-p", "The quick brown fox " * 4],
          "max_model_len")


def test_generate_exits_1_when_the_request_fails(tiny_models, monkeypatch, capsys):
    """A request that fails in the engine (here: a NaN temperature that validation would have refused) makes
    generate exit 1, not 0; --json still reports what happened."""
    from specdecode.entrypoints.cli import generate

    real = generate.sampling_params

    def poisoned(args, max_tokens=None):
        params = real(args, max_tokens)
        params.temperature = float("nan")  # set after validation: the engine's sampler fails the request
        return params

    monkeypatch.setattr(generate, "sampling_params", poisoned)
    assert main(["generate", "-m", str(tiny_models["llama"]), "-md", "none", "-t", "1", "-p", "hi", "-n", "4",
                 "--temp", "1", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "error" and out["error"]
    monkeypatch.setattr(generate, "sampling_params", real)
    assert main(["generate", "-m", str(tiny_models["llama"]), "-md", "none", "-t", "1", "-p", "hi", "-n", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["error"] is None


def test_generate_n_minus_one_runs_to_the_context(tiny_models, capsys):
    """llama.cpp's -n -1: no limit but the context (here 48 positions)."""
    from specdecode.entrypoints.cli import main

    assert main(["generate", "-m", str(tiny_models["llama"]), "-md", "none", "-t", "1", "--raw", "-p", "hi there",
                 "-n", "-1", "--ignore-eos", "--max-model-len", "48", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "length"
    assert len(out["prompt_token_ids"]) + len(out["token_ids"]) == 48
    assert main(["generate", "-m", str(tiny_models["llama"]), "-p", "hi", "-n", "-2"]) == 2


def test_chat_through_stdin(tiny_models):
    p = run_cli("chat", "-m", tiny_models["llama"], "-md", "ngram", "--draft", 2, "-n", 8, "-t", 1,
                input="hello there\n\n/reset\nThe quick brown fox\n/exit\nnot read\n")
    assert p.returncode == 0, p.stderr
    stats = [ln for ln in p.stderr.splitlines() if ln.startswith("[") and "tokens" in ln]
    assert len(stats) == 2, p.stderr  # one stats line per reply; nothing after /exit
    assert all("decode" in ln and "accept" in ln for ln in stats)
    assert "history cleared" in p.stderr
    assert p.stdout.strip()


def test_chat_ctrl_c_aborts_only_the_reply(tiny_models, tmp_path):
    """Ctrl-C lands while the reply is provably still being written: stdout is a pipe of one page that the test
    does not drain, and the reply (up to 60000 tokens, EOS ignored) is far longer, so the command cannot finish it
    before the test reads the rest; no clock decides which comes first."""
    import fcntl
    import select

    r, w = os.pipe()
    if hasattr(fcntl, "F_SETPIPE_SZ"):  # Linux; elsewhere the default pipe (16-64 KiB) is still far shorter
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    with open(tmp_path / "stderr", "w+b") as errf:
        proc = subprocess.Popen([sys.executable, "-m", "specdecode", "chat", "-m", str(tiny_models["llama"]),
                                 "-md", "none", "-n", "100000", "--ignore-eos", "--max-model-len", "60000",
                                 "-t", "1"], stdin=subprocess.PIPE, stdout=w, stderr=errf, cwd=ROOT,
                                env=dict(_env(), SPECDECODE_ALLOW_LONG_MAX_MODEL_LEN="1"))
        os.close(w)
        try:
            proc.stdin.write(b"tell me a long story\n")
            proc.stdin.flush()
            assert os.read(r, 1)  # the reply has started streaming
            proc.send_signal(signal.SIGINT)
            proc.stdin.write(b"/exit\n")
            proc.stdin.close()
            # Drain the reply so that the command can stop it; a silent minute ends the wait (and the test).
            while select.select([r], [], [], 60)[0] and os.read(r, 1 << 16):
                pass
            proc.wait(timeout=60)
        finally:
            os.close(r)
            if proc.poll() is None:
                proc.kill()
        errf.seek(0)
        err = errf.read().decode()
    assert proc.returncode == 0, err
    assert "interrupted" in err and "Traceback" not in err


def test_closed_standard_streams_and_a_bad_device_give_no_traceback(tiny_models, capsys):
    """Started with stdin or stdout closed (`<&-`, `>&-`): stdin reads as empty and output goes nowhere, as with
    /dev/null. An unknown --device is a one-line error before anything loads."""
    import shlex

    base = f"{shlex.quote(sys.executable)} -m specdecode"
    model = shlex.quote(str(tiny_models["llama"]))
    for cmd, code, needle in ((f"{base} generate -m {model} -f - <&-", 2, "error: the prompt is empty"),
                              (f"{base} chat -m {model} --spec-type none <&-", 0, "Commands:"),
                              (f"{base} generate -m {model} -p hi -n 2 --spec-type none >&-", 0, "load time")):
        p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env())
        assert p.returncode == code and needle in p.stderr and "Traceback" not in p.stderr, (cmd, p.stderr)
    from specdecode.entrypoints.cli import main

    for device, needle in (("bogus", "device must be"), ("meta", "holds no data")):
        assert main(["generate", "-m", str(tiny_models["llama"]), "-p", "hi", "--device", device]) == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and needle in err[0], err


def test_generate_refuses_flags_it_would_ignore(tiny_models, capsys):
    """--system without a chat template and --echo on a chat prompt did nothing; now each is a one-line error."""
    from specdecode.entrypoints.cli import main

    model = str(tiny_models["llama"])
    for extra, needle in ((["--raw", "--system", "Be brief."], "--system"), (["--echo", "--chat"], "--echo"),
                          (["--echo"], "add --raw")):
        assert main(["generate", "-m", model, "-p", "hi", "-n", "2", "-t", "1", *extra]) == 2, extra
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and needle in err[0], (extra, err)
    assert main(["generate", "-m", model, "-p", "hi", "-n", "2", "-t", "1", "--raw", "--echo"]) == 0
    assert capsys.readouterr().out.startswith("hi")
