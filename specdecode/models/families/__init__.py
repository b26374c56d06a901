"""The model families: one module each maps its HF config onto the shared decoder's switches (ModelArgs,
models.model) and its checkpoint tensors onto our parameter names."""
from __future__ import annotations

from specdecode.models.families.base import Family, GGUFArch
from specdecode.models.families.gemma import GEMMA
from specdecode.models.families.gemma import GGUF_ARCHS as _GEMMA_GGUF
from specdecode.models.families.gpt2 import GPT2
from specdecode.models.families.granite import GGUF_ARCHS as _GRANITE_GGUF
from specdecode.models.families.granite import GRANITE
from specdecode.models.families.llama import LLAMA
from specdecode.models.families.mistral import MISTRAL
from specdecode.models.families.mixtral import MIXTRAL
from specdecode.models.families.olmo2 import GGUF_ARCHS as _OLMO2_GGUF
from specdecode.models.families.olmo2 import OLMO2
from specdecode.models.families.opt import OPT
from specdecode.models.families.phi3 import GGUF_ARCHS as _PHI3_GGUF
from specdecode.models.families.phi3 import PHI3
from specdecode.models.families.qwen_moe import GGUF_ARCHS as _QWEN_MOE_GGUF
from specdecode.models.families.qwen_moe import QWEN_MOE

FAMILIES: dict[str, Family] = {
    "llama": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "opt": OPT, "gpt2": GPT2, "gemma2": GEMMA, "gemma3": GEMMA,
    # dense families beyond Llama's switches (one module each)
    "mistral": MISTRAL, "ministral": MISTRAL, "phi3": PHI3, "granite": GRANITE, "olmo2": OLMO2,
    # mixtures of experts (layers.moe)
    "mixtral": MIXTRAL, "qwen2_moe": QWEN_MOE, "qwen3_moe": QWEN_MOE,
}

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "OPTForCausalLM": "opt", "GPT2LMHeadModel": "gpt2",
    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
    "MistralForCausalLM": "mistral", "MinistralForCausalLM": "ministral", "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite", "Olmo2ForCausalLM": "olmo2",
    "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
}

# GGUF architectures (llama.cpp's names) that differ from Llama's layout beyond models.gguf_loader's own table.
GGUF_ARCHITECTURES: dict[str, GGUFArch] = {**_GEMMA_GGUF, **_PHI3_GGUF, **_GRANITE_GGUF, **_OLMO2_GGUF,
                                           **_QWEN_MOE_GGUF}


def family_of(hf_config: dict) -> str:
    """Our family name for an HF config, from its ``architectures``."""
    archs = hf_config.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    raise ValueError(f"Unsupported model architecture {archs or hf_config.get('model_type')!r}. "
                     f"Supported architectures: {', '.join(sorted(ARCHITECTURES))}.")


__all__ = ["ARCHITECTURES", "FAMILIES", "Family", "GGUFArch", "GGUF_ARCHITECTURES", "family_of"]
