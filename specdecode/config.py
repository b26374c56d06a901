"""The one configuration object: every user-facing knob is validated here, once.

Accepts vLLM's legacy keywords (speculative_model=..., num_speculative_tokens=...), vLLM's current
``speculative_config={...}`` dict and SGLang's names, and normalises them to ``SpeculativeConfig``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

logger = logging.getLogger("specdecode")

SPEC_METHODS = ("draft_model", "ngram")
# Shortest n-gram that counts as a match. Plain n-gram drafting takes any match (a draft is free, and there
# is nothing else to propose); with ngram_first a match replaces the draft model's proposal, and on
# Spec-Bench 1- and 2-token matches predict the next token far less often (about 5-40% and 20-60%) than
# the default draft does (about 70%), 3- and 4-token matches about as often or more.
NGRAM_MIN_DEFAULT = {"ngram": 1, "ngram_first": 3}
MAX_SPEC_TOKENS = 16


def default_lookup_min(ngram_first: bool, lookup_max: Any) -> int:
    """prompt_lookup_min when none is given: NGRAM_MIN_DEFAULT, never above a valid prompt_lookup_max."""
    default = NGRAM_MIN_DEFAULT["ngram_first" if ngram_first else "ngram"]
    return min(default, lookup_max) if isinstance(lookup_max, int) and lookup_max >= 1 else default

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "none", "int8", "w8a8", "w4a8")
QUANTIZATION_CHOICES = [q for q in QUANTIZATIONS if q]  # for command-line flags


def _err(msg: str) -> ValueError:
    return ValueError(msg)


@dataclass
class SpeculativeConfig:
    method: str = "draft_model"
    model: str | None = None  # draft model path (draft_model method only)
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int | None = None  # None: NGRAM_MIN_DEFAULT
    disable_by_batch_size: int | None = None
    # Stop drafting once the draft's top probability drops below this (llama.cpp's --draft-p-min).
    draft_p_min: float = 0.0
    # Stop drafting once the product of the draft's top probabilities, its own estimate that every token it
    # drafted is accepted, drops below this; num_speculative_tokens is then only the cap (with adaptive, k
    # only decides whether the draft model runs at all). 0: off.
    draft_confidence: float = 0.0
    # Choose k per request (k may drop to 0) from acceptance measured online and the costs of verify passes and
    # draft steps, timed when the engine starts (speculative/adaptive.py).
    adaptive: bool = False
    # Draft model only: score just N frequent tokens in the draft's LM head, plus special tokens and the tokens
    # of each request's own context (speculative/draft_vocab.py). Frequent means the first N of token_map, else of
    # the ranking shipped for this tokenizer, else the N lowest ids (a BPE vocabulary's earliest merges).
    # The head is a large share of a small draft's weights; drafts stay exact proposals, so output is
    # unchanged, only acceptance may dip.
    draft_vocab_size: int | None = None
    # Draft model only: a file of token ids, most frequent first (SGLang's speculative_token_map): JSON, or a
    # .pt tensor. Alone it keeps all its ids; with draft_vocab_size, the first N.
    token_map: str | None = None
    # Draft model only: its own weight format (vLLM's speculative_model_quantization). None: the target's;
    # "none": unquantized whatever the target uses.
    # A draft's precision only moves the acceptance rate, never the output, so "w4a8" (half the bytes of
    # w8a8) is usually the cheapest draft on a CPU.
    quantization: str | None = None
    # Draft model only: prompt lookup first (prompt_lookup_max down to prompt_lookup_min); the draft model
    # runs only for requests whose context ends in no n-gram seen before. With adaptive, each request
    # keeps the two kinds' acceptance apart and a step uses the one expected to give more tokens/s.
    ngram_first: bool = False
    # With ngram_first: the most tokens one lookup drafts (None: num_speculative_tokens, as in transformers'
    # prompt_lookup_num_tokens). A looked-up draft costs no draft-model pass, so inside a copied span it
    # pays to go deeper than the draft model does; with adaptive, k still follows each kind's acceptance.
    prompt_lookup_num_tokens: int | None = None

    @property
    def lookup_k(self) -> int:
        """The most tokens one lookup drafts (ngram_first)."""
        return self.prompt_lookup_num_tokens or self.num_speculative_tokens

    @property
    def max_k(self) -> int:
        """The most tokens any step drafts, whichever kind drafts them."""
        return max(self.num_speculative_tokens, self.lookup_k if self.ngram_first else 0)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise _err(f"Unknown speculative method {self.method!r}; valid methods are: "
                       f"{', '.join(SPEC_METHODS)} (or pass speculative_model='[ngram]' / a draft model path).")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not (1 <= k <= MAX_SPEC_TOKENS):
            raise _err(f"num_speculative_tokens must be an integer in 1..{MAX_SPEC_TOKENS}, got {k!r}: "
                       "k=0 would draft nothing (just drop the speculative settings to disable speculation), "
                       f"and beyond {MAX_SPEC_TOKENS} the chance that every draft is accepted is so small that "
                       "the extra verification work is wasted.")
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = default_lookup_min(self.ngram_first, self.prompt_lookup_max)
        if self.method == "ngram" or self.ngram_first:
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise _err(f"ngram lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got min={lo!r}, max={hi!r}.")
        if self.method == "draft_model" and not self.model:
            raise _err("speculative method 'draft_model' needs a draft model: pass speculative_model=PATH "
                       "(an HF directory or a .gguf file), or speculative_model='[ngram]' for n-gram lookup.")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise _err(f"speculative_disable_by_batch_size must be >= 1, got {self.disable_by_batch_size!r}.")
        if not (0.0 <= self.draft_p_min < 1.0):
            raise _err(f"draft_p_min must be in [0, 1), got {self.draft_p_min!r}.")
        c = self.draft_confidence
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not (0.0 <= c < 1.0):
            raise _err(f"draft_confidence must be a number in [0, 1) (e.g. 0.3; 0 turns it off), got {c!r}.")
        if c and self.method != "draft_model":
            raise _err("draft_confidence stops a draft model by its own probabilities; n-gram drafts have none.")
        v = self.draft_vocab_size
        if v is not None:
            if self.method != "draft_model":
                raise _err("draft_vocab_size only applies to a draft model (n-gram drafts need no LM head).")
            if not isinstance(v, int) or isinstance(v, bool) or v < 256:
                raise _err(f"draft_vocab_size must be an integer >= 256 (e.g. 32768), got {v!r}.")
        if self.token_map is not None:
            if self.method != "draft_model":
                raise _err("token_map only applies to a draft model (n-gram drafts need no LM head).")
            if not isinstance(self.token_map, (str, Path)) or not Path(self.token_map).is_file():
                raise _err(f"token_map must be the path of an existing file, got {self.token_map!r}.")
        if self.ngram_first and self.method != "draft_model":
            raise _err("ngram_first combines prompt lookup with a draft model; with method 'ngram' there is none.")
        n = self.prompt_lookup_num_tokens
        if n is not None:
            if not self.ngram_first:
                raise _err("prompt_lookup_num_tokens caps the lookups of ngram_first (prompt lookup before a draft "
                           "model); with method 'ngram' num_speculative_tokens is the cap.")
            if not isinstance(n, int) or isinstance(n, bool) or not (1 <= n <= MAX_SPEC_TOKENS):
                raise _err(f"prompt_lookup_num_tokens must be an integer in 1..{MAX_SPEC_TOKENS}, got {n!r}.")
        if self.quantization is not None:
            if self.method != "draft_model":
                raise _err("speculative quantization only applies to a draft model (n-gram drafting has none).")
            if self.quantization not in QUANTIZATIONS:
                raise _err(f"speculative quantization must be one of {', '.join(q for q in QUANTIZATIONS if q)}, "
                           f"got {self.quantization!r}.")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        d = dict(d)
        aliases = {"draft_model": "model", "num_draft_tokens": "num_speculative_tokens",
                   "ngram_prompt_lookup_max": "prompt_lookup_max", "ngram_prompt_lookup_min": "prompt_lookup_min",
                   "speculative_disable_by_batch_size": "disable_by_batch_size",
                   "speculative_model_quantization": "quantization", "speculative_token_map": "token_map"}
        for old, new in aliases.items():
            if old in d and new not in d:
                d[new] = d.pop(old)
        if d.get("model") in ("[ngram]", "ngram"):
            d["model"] = None
            d.setdefault("method", "ngram")
        if d.get("method") == "draft":
            d["method"] = "draft_model"
        if d.get("method") is None:
            d["method"] = "draft_model" if d.get("model") else "ngram"
        if d["method"] == "ngram":
            d["model"] = None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise _err(f"Unknown speculative_config keys {unknown}; valid keys are {sorted(known)}.")
        return cls(**d)


@dataclass
class EngineConfig:

    model: str | None = None  # None: the embedded default target
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None  # None: keep weights as loaded; "int8": per-channel int8 weight-only
    max_model_len: int | None = None
    max_num_seqs: int = 8
    seed: int = 0
    device: str = "auto"
    num_threads: int | None = None
    max_waiting_requests: int = 256
    compile: bool = False  # torch.compile the decode / verification layers where they run in Python
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise _err(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        if self.quantization == "none":
            self.quantization = None
        if self.quantization not in QUANTIZATIONS:
            raise _err(f"quantization must be 'int8' (int8 weights), 'w8a8' (int8 weights and activations), "
                       f"'w4a8' (4-bit weights, int8 activations) or None, got {self.quantization!r}.")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise _err(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}.")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise _err(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}.")
        if self.num_threads is not None and self.num_threads < 1:
            raise _err(f"num_threads must be >= 1, got {self.num_threads!r}.")
        if not isinstance(self.compile, bool):
            raise _err(f"compile must be True or False, got {self.compile!r}.")
        if self.device == "auto":
            import torch
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda"):
            import torch
            if not torch.cuda.is_available():
                raise _err(f"device={self.device!r} was requested but CUDA is not available; use device='cpu'.")
        draft_q = self.speculative.quantization if self.speculative is not None else None
        if draft_q not in (None, "none") and self.device != "cpu":
            raise _err(f"speculative quantization={draft_q!r} uses this package's CPU kernels and is not available "
                       f"on device={self.device!r}; on a GPU use dtype='bfloat16' or 'float16' instead.")
        if self.quantization is not None and self.device != "cpu":
            raise _err(f"quantization={self.quantization!r} uses this package's CPU kernels and is not available "
                       f"on device={self.device!r}; on a GPU use dtype='bfloat16' or 'float16' instead.")

    def draft_quantization(self) -> str | None:
        """The weight format the draft model loads with."""
        q = self.speculative.quantization if self.speculative is not None else None
        q = self.quantization if q is None else q
        return None if q == "none" else q

    @classmethod
    def from_kwargs(cls, **kw: Any) -> "EngineConfig":
        """Build from vLLM-style keyword arguments (legacy or current speculative form)."""
        spec_dict: dict[str, Any] | None = None
        sc = kw.pop("speculative_config", None)
        legacy = {k: kw.pop(k) for k in ("speculative_model", "num_speculative_tokens",
                                         "ngram_prompt_lookup_max", "ngram_prompt_lookup_min",
                                         "speculative_disable_by_batch_size", "speculative_draft_p_min",
                                         "speculative_draft_confidence",
                                         "speculative_adaptive", "speculative_draft_vocab_size",
                                         "speculative_model_quantization", "speculative_ngram_first",
                                         "speculative_token_map", "prompt_lookup_num_tokens") if k in kw}
        if sc is not None and legacy:
            raise _err("Pass either speculative_config={...} or the legacy speculative_* keywords, not both.")
        if isinstance(sc, SpeculativeConfig):
            spec = sc
        else:
            if sc is not None:
                if not isinstance(sc, dict):
                    raise _err("speculative_config must be a dict such as "
                               "{'method': 'ngram', 'num_speculative_tokens': 4}.")
                spec_dict = dict(sc)
            elif legacy:
                spec_dict = {"model": legacy.get("speculative_model")}
                for src, dst in (("num_speculative_tokens", "num_speculative_tokens"),
                                 ("ngram_prompt_lookup_max", "prompt_lookup_max"),
                                 ("ngram_prompt_lookup_min", "prompt_lookup_min"),
                                 ("speculative_disable_by_batch_size", "disable_by_batch_size"),
                                 ("speculative_draft_p_min", "draft_p_min"),
                                 ("speculative_draft_confidence", "draft_confidence"),
                                 ("speculative_adaptive", "adaptive"),
                                 ("speculative_draft_vocab_size", "draft_vocab_size"),
                                 ("speculative_model_quantization", "quantization"),
                                 ("speculative_ngram_first", "ngram_first"),
                                 ("speculative_token_map", "token_map"),
                                 ("prompt_lookup_num_tokens", "prompt_lookup_num_tokens")):
                    if legacy.get(src) is not None:
                        spec_dict[dst] = legacy[src]
                if spec_dict.get("model") is None:
                    raise _err("num_speculative_tokens was given without speculative_model; pass "
                               "speculative_model=PATH or speculative_model='[ngram]'.")
            spec = SpeculativeConfig.from_dict(spec_dict) if spec_dict is not None else None
        kw.pop("trust_remote_code", None)  # accepted for vLLM compatibility; nothing remote is ever run
        kw.pop("enforce_eager", None)
        if "threads" in kw:
            kw["num_threads"] = kw.pop("threads")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise _err(f"Unknown engine arguments {unknown}; valid ones are {sorted(known - {'speculative'})} "
                       "plus speculative_model, num_speculative_tokens, speculative_config.")
        return cls(speculative=spec, **kw)


def check_draft_compatible(target_tok, draft_tok, target_params: int, draft_params: int,
                           target_vocab: int, draft_vocab: int) -> None:
    """Target and draft must tokenize identically; a draft larger than the target is almost surely a mistake."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        only_d = len(set(dv.items()) - set(tv.items()))
        raise _err(f"The draft model's tokenizer does not match the target's ({only_t} target and {only_d} draft "
                   f"vocabulary entries differ; sizes {len(tv)} vs {len(dv)}). Speculative decoding needs the same "
                   "tokenizer: pick a draft from the same model family, or use speculative_model='[ngram]'.")
    # Embedding rows beyond the tokenizer's vocabulary are padding and may differ between the two.
    if min(target_vocab, draft_vocab) < len(tv):
        raise _err(f"A model's embedding table ({min(target_vocab, draft_vocab)} rows) is smaller than the "
                   f"tokenizer vocabulary ({len(tv)}).")
    if draft_params > target_params:
        logger.warning("The draft model (%.1fM parameters) is larger than the target (%.1fM parameters); "
                       "speculation will be slower than plain decoding.", draft_params / 1e6, target_params / 1e6)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")
