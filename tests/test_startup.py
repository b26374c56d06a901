"""Start-up runs without the cyclic garbage collector (specdecode/startup.py), and gives it back afterwards."""
from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from specdecode import LLM, startup
from specdecode.engine import llm_engine
from specdecode.entrypoints.cli import main

# Counts only the collections that run while torch's module executes (importlib marks a module's spec
# ``_initializing`` until it has run): what the package promises to pause. Collections before that, while the
# interpreter, a venv's site hooks (setuptools' _distutils_hack) and the standard library import, depend on the
# environment, not on the package.
_COUNT_IMPORT = """
import gc, sys
runs = []
def count(phase, info):
    torch = sys.modules.get("torch")
    if phase == "start" and torch is not None and getattr(torch.__spec__, "_initializing", False):
        runs.append(1)
gc.callbacks.append(count)
if sys.argv[1] == "off":
    gc.disable()
exec(sys.argv[2])
if "torch" in sys.modules:  # the mark the count relies on (else it would count nothing and prove nothing)
    assert hasattr(sys.modules["torch"].__spec__, "_initializing")
print(len(runs), gc.isenabled(), "torch" in sys.modules)
"""


def _count_collections(before: str, code: str) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-c", _COUNT_IMPORT, before, code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    runs, enabled, torch_loaded = p.stdout.split()
    return int(runs), enabled, torch_loaded


@pytest.mark.parametrize("before", ["on", "off"])
@pytest.mark.parametrize("code", ["from specdecode import LLM, SamplingParams",
                                  "import specdecode, torch",  # torch after the package, by the user
                                  "import specdecode.engine.llm_engine",  # a module that imports torch itself
                                  "import specdecode, torch, importlib.machinery as m\n"
                                  "assert isinstance(torch.__loader__, m.SourceFileLoader)\n"
                                  "assert torch.__spec__.loader is torch.__loader__"])
def test_importing_torch_through_the_package_runs_no_collections_and_leaves_the_collector_as_it_was(before, code):
    runs, enabled, torch_loaded = _count_collections(before, code)
    # importing torch alone runs hundreds of collections with the collector on
    assert runs <= 2, runs
    assert enabled == str(before == "on") and torch_loaded == "True"


def test_the_count_sees_the_collections_of_an_unpaused_torch_import():
    """The measure above can fail: torch imported without the package runs many collections."""
    assert _count_collections("on", "import torch")[0] > 2


def test_the_package_and_the_command_line_parser_do_not_import_torch():
    code = ("import contextlib, io\nfrom specdecode.entrypoints.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    assert main(['serve', '--help']) == 0\n"
            "assert main(['generate', '--max-tokens', 'many']) == 2")
    assert _count_collections("on", code)[2] == "False"


def test_the_server_module_parses_its_flags_before_importing_the_server():
    """``python -m specdecode.entrypoints.openai.api_server`` is ``specdecode serve``: --help and a bad flag
    answer without importing torch or the web stack."""
    cmd = [sys.executable, "-c", "import runpy, sys\n"
           "try:\n    runpy.run_module('specdecode.entrypoints.openai.api_server', run_name='__main__')\n"
           "finally:\n    print('loaded:', sorted({'torch', 'fastapi'} & set(sys.modules)), file=sys.stderr)"]
    helped = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--speculative-config" in helped.stdout and "--port" in helped.stdout
    assert "loaded: []" in helped.stderr, helped.stderr
    bad = subprocess.run([*cmd, "--no-such-flag"], capture_output=True, text=True, timeout=60)
    lines = [x for x in bad.stderr.splitlines() if x.strip()]
    assert bad.returncode == 2 and "--no-such-flag" in lines[0] and lines[1:] == ["loaded: []"], bad.stderr


@pytest.fixture
def gc_seen(monkeypatch):
    """Whether the collector was on while the engine loaded its models and while it ran steps."""
    seen: dict[str, list[bool]] = {"load": [], "step": []}
    load, step = llm_engine.load_model, llm_engine.LLMEngine.step

    def loading(*a, **k):
        seen["load"].append(gc.isenabled())
        return load(*a, **k)

    def stepping(self):
        seen["step"].append(gc.isenabled())
        return step(self)

    monkeypatch.setattr(llm_engine, "load_model", loading)
    monkeypatch.setattr(llm_engine.LLMEngine, "step", stepping)
    assert gc.isenabled()
    yield seen
    gc.enable()


def test_a_command_loads_without_the_collector_and_generates_with_it(tiny_models, gc_seen, capsys):
    assert main(["generate", "-m", str(tiny_models["llama"]), "-md", "none", "-t", "1", "--raw", "-p", "hi",
                 "-n", "4"]) == 0
    assert gc_seen["load"] == [False]
    assert gc_seen["step"] and all(gc_seen["step"])
    assert gc.isenabled()


def test_a_command_that_fails_before_its_engine_loads_gives_the_collector_back(tiny_models, tmp_path, gc_seen):
    assert main(["generate", "-m", str(tmp_path / "missing"), "-p", "hi"]) == 2
    assert gc_seen["load"] == [] and gc.isenabled()
    assert main(["generate", "-m", str(tiny_models["llama"]), "-p", "hi", "-n", "-2"]) == 2
    assert gc.isenabled()


def test_the_library_leaves_the_collector_alone(tiny_models, gc_seen):
    llm = LLM(model=str(tiny_models["llama"]), speculative_config={"method": "none"}, num_threads=1)
    llm.generate("hi", use_tqdm=False)
    assert gc_seen["load"] == [True] and all(gc_seen["step"])
    gc.disable()
    try:
        startup.resume()  # no pause pending: nothing to give back
        assert not gc.isenabled()
    finally:
        gc.enable()
