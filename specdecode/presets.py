"""The defaults, as one named preset: what ``LLM()``, ``Engine()`` and ``specdecode generate/chat/serve`` run
when no option says otherwise. Change the defaults here and nowhere else.

``FAST`` is the fastest configuration measured on CPU (docs/benchmarks.md has the runs behind it): a target whose
4-bit GGUF tensors stay 4-bit (w4a8, Q4_K blocks as stored), whose Q6_K ones stay 6-bit (w6a8, as stored) and
whose other ones are int8 (w8a8) ("mixed"), a
4-bit draft (w4a8), prompt lookup first and the draft model where nothing matches, k chosen
per step up to 4 for the draft model and 12 for lookups, and a draft head truncated to the 32768 most frequent
tokens where a frequency ranking is known for the tokenizer. Every part is an opt-out (see README).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    # Weight formats on CPU (quantization="auto"); "none" is full precision.
    target_quantization: str
    draft_quantization: str
    # dtype="auto" on a GPU (the integer formats are CPU kernels).
    cuda_dtype: str
    # Checkpoints smaller than this keep full precision under quantization="auto": their weights fit in the
    # CPU caches, so decoding is not bound by weight bandwidth and integer formats would only cost accuracy.
    quantize_min_bytes: int
    # The speculative policy, used when the user leaves k (num_speculative_tokens) to the preset.
    num_speculative_tokens: int   # the draft model's k (with adaptive: its cap)
    lookup_tokens: int            # the most tokens one prompt lookup drafts (model-free methods: their k)
    adaptive: bool
    ngram_first: bool
    # Truncated draft head (draft_vocab_size="auto"), only for tokenizers with a known frequency ranking.
    draft_vocab_size: int


FAST = Preset(name="fast", target_quantization="mixed", draft_quantization="w4a8", cuda_dtype="bfloat16",
              quantize_min_bytes=64 << 20, num_speculative_tokens=4, lookup_tokens=12, adaptive=True,
              ngram_first=True, draft_vocab_size=32768)

DEFAULT = FAST
