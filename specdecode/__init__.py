"""specdecode: small, exact speculative decoding (draft-model and n-gram proposers)."""
import importlib as _importlib
import typing as _typing

from specdecode import startup as _startup

if _typing.TYPE_CHECKING:
    from specdecode.config import EngineConfig, SpeculativeConfig
    from specdecode.llm import LLM, Engine
    from specdecode.outputs import CompletionOutput, Logprob, RequestOutput
    from specdecode.sampling_params import SamplingParams

# The public names load on first use (PEP 562), so the command line parses its flags, prints --help and
# reports a bad flag without importing torch; the commands that load an engine import it afterwards.
_startup.pause_torch_import()

_EXPORTS = {"EngineConfig": "config", "SpeculativeConfig": "config", "LLM": "llm", "Engine": "llm",
            "CompletionOutput": "outputs", "Logprob": "outputs", "RequestOutput": "outputs",
            "SamplingParams": "sampling_params"}
__all__ = ["LLM", "Engine", "SamplingParams", "SpeculativeConfig", "EngineConfig", "RequestOutput",
           "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        with _startup.paused():  # the engine's modules create many long-lived objects as they import
            value = getattr(_importlib.import_module(f"specdecode.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specdecode' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
