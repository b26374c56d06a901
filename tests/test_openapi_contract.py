"""schemathesis against the real server's /openapi.json, every check on (status codes, content types, response
schemas, valid requests accepted, invalid ones refused, ...), with a bounded number of examples per operation.
The hooks in tests/schemathesis_hooks.py apply the rules that tie fields together (docs/server.md)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specdecode.entrypoints.openai.api_server import build_app
from test_server import MAX_LEN, MODEL, serve

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def url(tiny_models):
    kw = {"model": str(tiny_models["llama"]), "speculative_model": "[ngram]", "num_speculative_tokens": 3,
          "max_model_len": MAX_LEN, "max_num_seqs": 8}
    with serve(build_app(kw, MODEL, None)) as u:
        yield u


def test_schemathesis_finds_nothing(url, tmp_path):
    st = shutil.which("st", path=os.path.dirname(sys.executable)) or shutil.which("st")
    assert st is not None, "schemathesis is in the test extra"
    env = dict(os.environ, SCHEMATHESIS_HOOKS="schemathesis_hooks", SPECDECODE_TEST_MODEL=MODEL,
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([st, "run", f"{url}/openapi.json", "--checks", "all", "--phases", "examples,fuzzing",
                        "--max-examples", "6", "--max-time", "30", "--seed", "62", "--workers", "1",
                        "--request-timeout", "60", "--no-shrink", "--report-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert "12 selected / 12 total" in out, out[-3000:]
    assert r.returncode == 0, out[out.find("FAILURES"):][:12000]
