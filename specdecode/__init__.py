"""specdecode: small, exact speculative decoding (draft-model and n-gram proposers)."""
from specdecode import startup as _startup

with _startup.paused():  # importing torch with the collector on spends much of the import in collections (startup.py)
    from specdecode.config import EngineConfig, SpeculativeConfig
    from specdecode.llm import LLM, Engine
    from specdecode.outputs import CompletionOutput, Logprob, RequestOutput
    from specdecode.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "SamplingParams", "SpeculativeConfig", "EngineConfig", "RequestOutput",
           "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
