"""The configuration objects, validated once: ``EngineConfig`` and its ``SpeculativeConfig``.

Keyword arguments reach them through ``EngineConfig.from_kwargs``: the option table (``specdecode.options``)
maps every accepted spelling (vLLM's current ``speculative_config={...}`` and legacy keywords, SGLang's names)
to one name, and the preset (``specdecode.presets``) fills what the user leaves unset.
"""
from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode import presets
from specdecode.options import (DTYPES, MAX_SPEC_TOKENS, NGRAM_MODELS, NO_DRAFT, QUANTIZATIONS, SPEC_METHODS,
                                parse_method, speculative_fields, split_kwargs)

logger = logging.getLogger("specdecode")

# Shortest n-gram that counts as a match. Plain n-gram drafting takes any match (a draft is free, and there
# is nothing else to propose); with ngram_first a match replaces the draft model's proposal, and 1- and
# 2-token matches predict the next token far less often than the draft model does (docs/benchmarks.md),
# 3- and 4-token matches about as often or more.
NGRAM_MIN_DEFAULT = {"ngram": 1, "ngram_first": 3}
QUANTIZATION_CHOICES = [q for q in QUANTIZATIONS if q != "auto"]  # weight formats, for messages


def default_lookup_min(ngram_first: bool, lookup_max: Any) -> int:
    """prompt_lookup_min when none is given: NGRAM_MIN_DEFAULT, never above a valid prompt_lookup_max."""
    default = NGRAM_MIN_DEFAULT["ngram_first" if ngram_first else "ngram"]
    return min(default, lookup_max) if isinstance(lookup_max, int) and lookup_max >= 1 else default


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


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
    # draft steps, timed when the engine starts (speculative/adaptive/).
    adaptive: bool = False
    # Draft model only: score just N frequent tokens in the draft's LM head, plus special tokens and the tokens
    # of each request's own context (speculative/draft_vocab.py). Frequent means the first N of token_map, else of
    # the ranking shipped for this tokenizer, else the N lowest ids (a BPE vocabulary's earliest merges).
    # "auto": the preset's N where a ranking is known for the tokenizer, else the full head.
    # The head is a large share of a small draft's weights; drafts stay exact proposals, so output is
    # unchanged, only acceptance may dip.
    draft_vocab_size: int | str | None = None
    # Draft model only: a file of token ids, most frequent first (SGLang's speculative_token_map): JSON, or a
    # .pt tensor. Alone it keeps all its ids; with draft_vocab_size, the first N.
    token_map: str | None = None
    # Draft model only: its own weight format (vLLM's speculative_model_quantization). None: the target's;
    # "none": unquantized whatever the target uses; "auto": resolved by EngineConfig (the preset's draft
    # format when the target is quantized, else the target's).
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
    # Suffix decoding (method "suffix"), vLLM's names and defaults: the index's deepest match, the earlier
    # requests it keeps, the draft length as a multiple of the match length, and the lowest estimated
    # probability a drafted token may have.
    # Draft model only: its context for a long sequence, the first DRAFT_SINKS tokens plus the last N to 2N
    # (speculative.draft_model). None: DEFAULT_DRAFT_WINDOW; 0: the whole context.
    draft_window: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @property
    def uses_draft_model(self) -> bool:
        """draft_model, or suffix decoding with a draft model (suffix matches first, as ngram_first)."""
        return self.method == "draft_model" or (self.method == "suffix" and bool(self.model))

    @property
    def lookup_k(self) -> int:
        """The most tokens one lookup drafts (ngram_first)."""
        return self.prompt_lookup_num_tokens or self.num_speculative_tokens

    @property
    def max_k(self) -> int:
        """The most tokens any step drafts, whichever kind drafts them."""
        hybrid = self.ngram_first or (self.method == "suffix" and self.uses_draft_model)
        return max(self.num_speculative_tokens, self.lookup_k if hybrid else 0)

    def head_size(self, ranking_known: bool) -> int | None:
        """The draft head's size: draft_vocab_size, with "auto" resolved (the preset's size where a frequency
        ranking is known for the tokenizer, else None: the full head)."""
        if self.draft_vocab_size == "auto":
            return presets.DEFAULT.draft_vocab_size if ranking_known else None
        return self.draft_vocab_size

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            self.method = parse_method(self.method)  # other spellings; raises for unknown ones
            if self.method not in SPEC_METHODS:
                raise ValueError("method 'none' means no speculation: pass speculative_config=None "
                                 "(SpeculativeConfig describes a speculative method).")
        if self.method == "suffix" and importlib.util.find_spec("specdecode.speculative.suffix") is None:
            raise ValueError("speculative method 'suffix' is not available in this build; use ngram or draft_model.")
        k = self.num_speculative_tokens
        if not _is_int(k) or not (1 <= k <= MAX_SPEC_TOKENS):
            raise ValueError(f"num_speculative_tokens must be an integer in 1..{MAX_SPEC_TOKENS}, got {k!r}: "
                             "k=0 would draft nothing (pass method 'none' / --spec-type none to disable speculation), "
                             f"and beyond {MAX_SPEC_TOKENS} the chance that every draft is accepted is so small that "
                             "the extra verification work is wasted.")
        if self.prompt_lookup_min is None:
            self.prompt_lookup_min = default_lookup_min(self.ngram_first, self.prompt_lookup_max)
        if self.method == "ngram" or self.ngram_first:
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi):
                raise ValueError(f"ngram lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got min={lo!r}, "
                                 f"max={hi!r}.")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs a draft model: pass speculative_model=PATH "
                             "(an HF directory or a .gguf file), or speculative_model='[ngram]' for n-gram lookup.")
        if self.disable_by_batch_size is not None and (not _is_int(self.disable_by_batch_size)
                                                       or self.disable_by_batch_size < 1):
            raise ValueError(f"speculative_disable_by_batch_size must be an integer >= 1, got "
                             f"{self.disable_by_batch_size!r}.")
        for name in ("draft_p_min", "draft_confidence"):
            c = getattr(self, name)
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not (0.0 <= c < 1.0):
                raise ValueError(f"{name} must be a number in [0, 1) (e.g. 0.3; 0 turns it off), got {c!r}.")
        if self.draft_confidence and not self.uses_draft_model:
            raise ValueError("draft_confidence stops a draft model by its own probabilities; n-gram drafts have none.")
        for name in ("adaptive", "ngram_first"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        v = self.draft_vocab_size
        if v is not None:
            if not self.uses_draft_model:
                raise ValueError("draft_vocab_size only applies to a draft model (n-gram drafts need no LM head).")
            if v != "auto" and (not _is_int(v) or v < 256):
                raise ValueError(f"draft_vocab_size must be 'auto' or an integer >= 256 (e.g. 32768), got {v!r}.")
        w = self.draft_window
        if w is not None:
            if not self.uses_draft_model:
                raise ValueError("draft_window bounds a draft model's context; n-gram and suffix lookups keep the "
                                 "whole context.")
            if not _is_int(w) or w < 0:
                raise ValueError(f"draft_window must be an integer >= 0 (0: the whole context), got {w!r}.")
        if self.token_map is not None:
            if not self.uses_draft_model:
                raise ValueError("token_map only applies to a draft model (n-gram drafts need no LM head).")
            if not isinstance(self.token_map, (str, Path)) or not Path(self.token_map).is_file():
                raise ValueError(f"token_map must be the path of an existing file, got {self.token_map!r}.")
        if self.ngram_first and self.method != "draft_model":
            raise ValueError("ngram_first combines prompt lookup with a draft model; with method "
                             f"{self.method!r} there is none.")
        n = self.prompt_lookup_num_tokens
        if n is not None:
            if not (self.ngram_first or (self.method == "suffix" and self.uses_draft_model)):
                raise ValueError("prompt_lookup_num_tokens caps the lookups of ngram_first (prompt lookup before a "
                                 "draft model); with method 'ngram' num_speculative_tokens is the cap.")
            if not _is_int(n) or not (1 <= n <= MAX_SPEC_TOKENS):
                raise ValueError(f"prompt_lookup_num_tokens must be an integer in 1..{MAX_SPEC_TOKENS}, got {n!r}.")
        if self.quantization is not None:
            if not self.uses_draft_model:
                raise ValueError("speculative quantization only applies to a draft model (n-gram drafting has none).")
            if self.quantization not in QUANTIZATIONS:
                raise ValueError(f"speculative quantization must be one of {', '.join(QUANTIZATIONS)}, "
                                 f"got {self.quantization!r}.")
        for name, lo in (("suffix_decoding_max_tree_depth", 1), ("suffix_decoding_max_cached_requests", 0)):
            if not _is_int(getattr(self, name)) or getattr(self, name) < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {getattr(self, name)!r}.")
        f, p = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
            raise ValueError(f"suffix_decoding_max_spec_factor must be a number > 0, got {f!r}.")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"suffix_decoding_min_token_prob must be a number in [0, 1], got {p!r}.")


def _method_named(method: str | None, model: Any) -> tuple[str | None, bool]:
    """(the method, whether the draft's name gave it): a draft named none/off stands for method "none" and
    '[ngram]' for "ngram"; such a name and a different method disagree (ValueError). Otherwise ``method``."""
    name = model.strip().lower() if isinstance(model, str) else None
    named = "none" if name in NO_DRAFT else "ngram" if name in NGRAM_MODELS else None
    if named is None:
        return method, False
    if method is not None and method != named:
        raise ValueError(f"speculative model {model!r} and method {method!r} disagree; pass one of them.")
    return named, True


def speculation_off(config: dict[str, Any]) -> bool:
    """Whether a ``speculative_config`` dict is the off switch: method "none", or a draft named none/off, read
    as ``speculative_config`` reads it."""
    fields_ = speculative_fields(config)
    return _method_named(fields_.get("method"), fields_.get("model"))[0] == "none"


def resolve_speculative(given: dict[str, Any], default_target: bool, from_dict: bool = False,
                        preset: presets.Preset = presets.DEFAULT) -> SpeculativeConfig | None:
    """The speculative config for the fields a user gave (None: no speculation).

    The method: "none" (or a draft named none/off) turns speculation off; '[ngram]' as the draft means prompt
    lookup; a draft model means draft_model; the built-in target with nothing given gets the built-in draft.
    The preset's policy (adaptive k, prompt lookup before the draft model, lookups up to 12) applies when k
    (num_speculative_tokens) is left unset; giving k fixes it and asks for exactly the named method, as in vLLM.
    The draft's weight format and truncated head follow the preset unless given."""
    spec = dict(given)
    method, named = _method_named(spec.pop("method", None), spec.get("model"))
    if named:
        spec.pop("model")
    if method == "none":
        return None
    if method is None:
        if "model" in spec:
            method = "draft_model"
        elif from_dict:
            method = "ngram"  # vLLM: a speculative_config without a draft model is n-gram lookup
        elif default_target:
            method = "draft_model"
        elif spec:
            raise ValueError(f"speculative options {sorted(spec)} were given without a draft: pass "
                             "speculative_model=PATH (-md DRAFT), or speculative_model='[ngram]' (--spec-type ngram) "
                             "for prompt lookup.")
        else:
            return None  # a user's target and nothing speculative: plain decoding, as in vLLM and llama.cpp
    if method == "draft_model" and "model" not in spec and default_target:
        spec["model"] = "default"
    if "num_speculative_tokens" not in spec:
        spec["num_speculative_tokens"] = (preset.num_speculative_tokens if method == "draft_model"
                                          else preset.lookup_tokens)
        spec.setdefault("adaptive", preset.adaptive)
        if method == "draft_model":
            spec.setdefault("ngram_first", preset.ngram_first)
            if spec["ngram_first"]:
                spec.setdefault("prompt_lookup_num_tokens", preset.lookup_tokens)
    if method == "draft_model" or (method == "suffix" and spec.get("model")):
        spec.setdefault("quantization", "auto")
        if spec.get("draft_vocab_size") in (0, "0", "none", "full"):
            spec["draft_vocab_size"] = None  # given: the full head
        elif "token_map" not in spec:
            spec.setdefault("draft_vocab_size", "auto")
    return SpeculativeConfig(method=method, **spec)


def speculative_config(value: SpeculativeConfig | dict[str, Any] | None,
                       default_target: bool = False) -> SpeculativeConfig | None:
    """vLLM's ``speculative_config`` -> the SpeculativeConfig (None: no speculation), the same for every entry
    point: ``LLM(speculative_config=...)``, ``LLMEngine.set_speculative``, and the ``--speculative-config`` flag of
    generate, chat and serve. A dict's keys may be any accepted spelling; the preset applies unless k is given
    (``resolve_speculative``); a dict with neither a draft model nor a method is n-gram lookup, as in vLLM.
    A SpeculativeConfig, or None, is taken as it is. ``default_target``: the target is the built-in one."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError("speculative_config must be a dict such as "
                         "{'method': 'ngram', 'num_speculative_tokens': 4}.")
    return resolve_speculative(speculative_fields(value), default_target, from_dict=True)


def checkpoint_bytes(model: str | None, role: str) -> float | None:
    """Bytes of a model's weights on disk (inf for the built-in pair, None when not found)."""
    if model is None or str(model).strip() in ("", "default"):
        return math.inf
    path = Path(str(model)).expanduser()
    if not path.exists():
        try:
            from specdecode.models.resolve import resolve_model
            path = resolve_model(model, role)
        except ValueError:
            return None
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir()
               if p.is_file() and p.suffix in (".safetensors", ".bin", ".gguf", ".pt", ".pth"))


def _quantize_worthy(model: str | None, role: str, preset: presets.Preset) -> bool:
    """Whether a checkpoint is large enough for the preset's integer formats (preset.quantize_min_bytes)."""
    size = checkpoint_bytes(model, role)
    return size is not None and size >= preset.quantize_min_bytes


@dataclass
class EngineConfig:

    model: str | None = None  # None: the embedded default target
    dtype: str = "auto"
    # "auto": the preset's integer formats on CPU for checkpoints large enough to gain from them, full
    # precision otherwise; None or "none": full precision; "int8": per-channel int8 weight-only; "w8a8", "w4a8",
    # "mixed" (w4a8 for a GGUF's 4-bit tensors, its Q6_K blocks as stored for Q6_K ones, w8a8 for the rest).
    quantization: str | None = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 8
    seed: int = 0
    device: str = "auto"
    num_threads: int | None = None
    max_waiting_requests: int = 256
    compile: bool = False  # torch.compile the decode / verification layers where they run in Python
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None  # None: engine.scheduler.DEFAULT_BATCHED_TOKENS
    kv_cache_memory: float | None = None  # GiB; None: room for max_num_seqs x max_model_len
    # vLLM's name: "auto" (16-bit on CPU, the model dtype elsewhere), float16, bfloat16, float32, int8 (q8_0)
    kv_cache_dtype: str = "auto"
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}.")
        if self.quantization not in (None,) + QUANTIZATIONS:
            raise ValueError(f"quantization must be 'auto', 'none', 'int8' (int8 weights), 'w8a8' (int8 weights and "
                             f"activations), 'w4a8' (4-bit weights, int8 activations) or 'mixed' (the formats that hold "
                             f"a GGUF's Q4_K and Q6_K tensors as stored, w8a8 elsewhere), got {self.quantization!r}.")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}.")
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}.")
        if self.num_threads is not None and (not _is_int(self.num_threads) or self.num_threads < 1):
            raise ValueError(f"num_threads must be an integer >= 1, got {self.num_threads!r}.")
        if not _is_int(self.seed) or not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}.")
        if not _is_int(self.max_waiting_requests) or self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be an integer >= 1, got {self.max_waiting_requests!r}.")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}.")
        if self.max_num_batched_tokens is not None and (not _is_int(self.max_num_batched_tokens)
                                                        or self.max_num_batched_tokens < 16):
            raise ValueError(f"max_num_batched_tokens must be an integer >= 16, got {self.max_num_batched_tokens!r}.")
        if self.kv_cache_memory is not None and (isinstance(self.kv_cache_memory, bool)
                                                 or not isinstance(self.kv_cache_memory, (int, float))
                                                 or not 0 < self.kv_cache_memory < float("inf")):
            raise ValueError(f"kv_cache_memory must be a positive number of GiB, got {self.kv_cache_memory!r}.")
        from specdecode.engine.kv_cache import check_kv_cache_dtype
        check_kv_cache_dtype(self.kv_cache_dtype)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}.")
        if self.device == "auto":
            import torch
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self._check_device()
        if self.device.startswith("cuda"):
            import torch
            if not torch.cuda.is_available():
                raise ValueError(f"device={self.device!r} was requested but CUDA is not available; use device='cpu'.")
        self._resolve_weight_formats(presets.DEFAULT)
        draft_q = self.speculative.quantization if self.speculative is not None else None
        if draft_q not in (None, "none") and self.device != "cpu":
            raise ValueError(f"speculative quantization={draft_q!r} uses this package's CPU kernels and is not "
                             f"available on device={self.device!r}; on a GPU use dtype='bfloat16' or 'float16' "
                             "instead.")
        if self.quantization is not None and self.device != "cpu":
            raise ValueError(f"quantization={self.quantization!r} uses this package's CPU kernels and is not "
                             f"available on device={self.device!r}; on a GPU use dtype='bfloat16' or 'float16' "
                             "instead.")

    def _check_device(self) -> None:
        import torch

        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}.") from None
        if device.type == "meta":
            raise ValueError("device 'meta' holds no data: use 'cpu' or 'cuda'.")
        self.device = str(device)

    def _resolve_weight_formats(self, preset: presets.Preset) -> None:
        """'auto' -> concrete formats: the preset's on CPU for checkpoints of at least preset.quantize_min_bytes
        (an explicit dtype means float weights of that dtype); on a GPU, the preset's dtype."""
        on_cpu = self.device == "cpu"
        if self.dtype == "auto" and not on_cpu:
            self.dtype = preset.cuda_dtype
        if self.quantization == "auto":
            auto_ok = on_cpu and self.dtype == "auto"
            big = auto_ok and _quantize_worthy(self.model, "target", preset)
            self.quantization = preset.target_quantization if big else None
        elif self.quantization == "none":
            self.quantization = None
        if self.speculative is not None:
            self._resolve_draft_format(self.speculative, preset)

    def _resolve_draft_format(self, spec: SpeculativeConfig, preset: presets.Preset) -> None:
        """A draft format "auto" -> concrete: the preset's draft format with a quantized target (self.quantization
        already resolved) and a draft of at least preset.quantize_min_bytes; otherwise the target's."""
        if spec.quantization == "auto":
            big_draft = self.quantization is not None and _quantize_worthy(spec.model, "draft", preset)
            spec.quantization = preset.draft_quantization if big_draft else None

    def speculative_for(self, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """What ``speculative_config`` gives for this engine's target, its draft format resolved against the
        target's as at start-up (``LLMEngine.set_speculative``): the config a fresh engine would get."""
        spec = speculative_config(value, self.model in (None, "", "default"))
        if spec is not None and spec is not value:
            self._resolve_draft_format(spec, presets.DEFAULT)
        return spec

    def draft_quantization(self) -> str | None:
        """The weight format the draft model loads with."""
        q = self.speculative.quantization if self.speculative is not None else None
        q = self.quantization if q is None else q
        return None if q == "none" else q

    @classmethod
    def from_kwargs(cls, **kw: Any) -> "EngineConfig":
        """Build from keyword arguments in any accepted spelling (see ``specdecode.options``); the preset fills
        what is not given."""
        engine, spec, sc = split_kwargs(kw)
        if sc is not None and spec:
            raise ValueError("Pass either speculative_config={...} or the legacy speculative_* keywords, not both.")
        default_target = engine.get("model") in (None, "", "default")
        if sc is not None:
            speculative = speculative_config(sc, default_target)
        else:
            speculative = resolve_speculative(spec, default_target)
        return cls(speculative=speculative, **engine)


def _vocab_parts(tok) -> tuple[dict[str, int], dict[str, int]]:
    """(base vocabulary, added tokens) of a tokenizer, each as token -> id."""
    added = {str(t): i for i, t in tok.added_tokens_decoder.items()}
    return {k: v for k, v in tok.get_vocab().items() if k not in added}, added


def _some(tokens: set[str], n: int = 3) -> str:
    return ", ".join(repr(t) for t in sorted(tokens)[:n]) + (", ..." if len(tokens) > n else "")


# A draft step must cost well under a target step for speculation to pay: above this parameter ratio it cannot.
DRAFT_SIZE_LIMIT = 0.5


def check_draft_compatible(target_tok, draft_tok, target_params: int, draft_params: int,
                           target_vocab: int, draft_vocab: int, target_name: str = "the target",
                           draft_name: str = "the draft") -> None:
    """Target and draft must tokenize identically. Where only their added special tokens differ, the draft still
    works (the target verifies every token) and a warning says so; a draft that is not much smaller than the
    target gets a warning that it cannot pay. ``draft_tok`` None: the draft's tokenizer files are the target's
    (tokenizer.same_tokenizer_files)."""
    ids = max(target_tok.get_vocab().values(), default=-1) + 1
    if draft_tok is not None:
        (tb, ta), (db, da) = _vocab_parts(target_tok), _vocab_parts(draft_tok)
        if tb != db:
            differ = {k for k in tb.keys() | db.keys() if tb.get(k) != db.get(k)}
            raise ValueError(f"The draft model {draft_name} does not share the tokenizer of the target model "
                             f"{target_name}: {len(differ)} vocabulary entries differ (for example {_some(differ)}; "
                             f"sizes {len(tb)} and {len(db)}). Speculative decoding needs the same tokenizer: pick a "
                             "draft from the target's family, or use speculative_model='[ngram]'.")
        if ta != da:
            only_t = {k for k in ta if da.get(k) != ta[k]}
            only_d = {k for k in da if ta.get(k) != da[k]}
            logger.warning("The draft model %s and the target %s differ only in added special tokens (the target's "
                           "%s; the draft's %s). Speculating anyway: the target verifies every token.", draft_name,
                           target_name, _some(only_t) or "none", _some(only_d) or "none")
        ids = max(ids, max(draft_tok.get_vocab().values(), default=-1) + 1)
    # Embedding rows beyond the tokenizer's vocabulary are padding and may differ between the two.
    if min(target_vocab, draft_vocab) < ids:
        which = draft_name if draft_vocab < target_vocab else target_name
        raise ValueError(f"The embedding table of {which} ({min(target_vocab, draft_vocab)} rows) is smaller than "
                         f"the token ids the two tokenizers use (0..{ids - 1}).")
    if draft_params > DRAFT_SIZE_LIMIT * target_params:
        size = "larger than" if draft_params > target_params else "not much smaller than"
        logger.warning("The draft model %s (%.1fM parameters) is %s the target %s (%.1fM parameters): its steps "
                       "cost about as much as the target's, so speculation cannot pay and will be slower than plain "
                       "decoding. Use a draft a few times smaller, or --spec-type ngram.", draft_name,
                       draft_params / 1e6, size, target_name, target_params / 1e6)

