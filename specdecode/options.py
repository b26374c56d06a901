"""Every engine and speculative option, declared once.

Each ``Option`` names the option (vLLM's name where vLLM has one), its type, default, help and the other
spellings users bring: vLLM's legacy keywords, SGLang's and llama.cpp's. This one table generates

* the keyword handling of ``LLM``, ``Engine``, ``LLMEngine.from_kwargs`` and ``AsyncLLMEngine.from_kwargs``
  (``split_kwargs``; ``EngineConfig.from_kwargs`` then applies the preset of ``specdecode.presets``),
* the keys ``speculative_config={...}`` accepts (``speculative_fields``),
* the command-line flags of ``generate``, ``chat``, ``serve`` and ``bench`` (``add_options``,
  ``kwargs_from_args``), with the same names in every subcommand,
* the option reference, ``specdecode options`` and docs/options.md (``markdown_table``).

The sampling flags (``SAMPLING_FLAGS``, ``add_sampling_flags``) are declared here too, once for every command
that takes them.

A value of None always means "not given": the preset decides.
"""
from __future__ import annotations

import argparse
import difflib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from specdecode.parsers import choice, float_in, int_at_least, list_of
from specdecode.structured.tools import tool_parser_names

logger = logging.getLogger("specdecode")

MAX_SPEC_TOKENS = 16
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "w8a8", "w4a8", "mixed")
SPEC_METHODS = ("draft_model", "ngram", "suffix")
NO_DRAFT = ("none", "off", "no", "0", "false", "disabled")
NGRAM_MODELS = ("[ngram]", "ngram")

# Speculative method names as vLLM, SGLang (speculative_algorithm) and llama.cpp (--spec-type) spell them.
_METHOD_NAMES = {
    **{n: "none" for n in NO_DRAFT},
    "draft_model": "draft_model", "draft": "draft_model", "draft-model": "draft_model", "standalone": "draft_model",
    "ngram": "ngram", "[ngram]": "ngram", "lookup": "ngram", "prompt_lookup": "ngram", "ngram-simple": "ngram",
    "ngram-map-k": "ngram", "ngram-map-k4v": "ngram", "ngram-cache": "ngram",
    "suffix": "suffix", "ngram-mod": "suffix",
}
_NOT_IMPLEMENTED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "lookahead", "deepseek_mtp")


def parse_method(value: Any) -> str:
    """A speculative method in any of the accepted spellings -> draft_model, ngram, suffix or none."""
    name = str(value).strip().lower()
    if name in _METHOD_NAMES:
        return _METHOD_NAMES[name]
    extra = " (EAGLE/Medusa/MTP heads are not implemented here)" if name in _NOT_IMPLEMENTED_METHODS else ""
    raise ValueError(f"Unknown speculative method {value!r}{extra}; valid methods are: draft_model (or draft), "
                     "ngram, suffix, none (or pass speculative_model='[ngram]' / a draft model path).")


# ---------------------------------------------------------------- command-line value parsers
def _draft_vocab(s: str) -> int | str:
    """auto, 0 / none / full (the whole head), or a size >= 256."""
    t = str(s).strip().lower()
    if t == "auto":
        return "auto"
    if t in ("none", "full", "0"):
        return 0
    v = int(t) if t.lstrip("-").isdigit() else None
    if v is None or v < 256:
        raise ValueError(f"must be auto, 0 (the full head) or >= 256, got {s}")
    return v


def _sglang_num_draft_tokens(v: Any) -> Any:
    """SGLang's speculative_num_draft_tokens counts the verified token too: k = value - 1."""
    if isinstance(v, bool) or not isinstance(v, int):
        return v
    if v < 2:
        raise ValueError(f"speculative_num_draft_tokens counts the verified token too (as in SGLang), so it must "
                         f"be 2..{MAX_SPEC_TOKENS + 1} (k = value - 1), got {v}.")
    return v - 1


@dataclass(frozen=True, eq=False)
class Option:
    name: str                       # the keyword / speculative_config key (vLLM's name where it has one)
    help: str
    scope: str = "engine"           # "engine": an EngineConfig field; "speculative": a SpeculativeConfig field;
    #                                 "server": a flag of `serve` only (no Python keyword)
    parse: Callable[[str], Any] = str  # command-line string -> value (Python values go to the config as given)
    default: str = ""               # what an unset option means, for help and docs
    kwargs: tuple[str, ...] = ()    # top-level keywords (vLLM legacy, SGLang); speculative options' first one
    keys: tuple[str, ...] = ()      # other keys speculative_config accepts
    flags: tuple[str, ...] = ()     # command-line spellings, the first one shown first: vLLM, SGLang, llama.cpp
    transforms: dict = field(default_factory=dict)  # spelling -> value conversion (SGLang's k + 1)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    boolean: bool = False           # a switch: --flag / --no-flag
    sweep: bool = False             # bench: a comma-separated list, one config per value
    sweep_parse: Callable[[str], Any] | None = None  # bench's parser for one value of that list
    bench: bool = True              # offered by `specdecode bench`
    group: str = "engine"

    @property
    def field(self) -> str:
        return self.name

    @property
    def keywords(self) -> tuple[str, ...]:
        """Every top-level keyword spelling; speculative options are not top-level under their key alone."""
        if self.scope == "server":
            return ()
        return self.kwargs if self.scope == "speculative" else (self.name,) + self.kwargs

    @property
    def convert(self) -> Callable[[Any], Any] | None:
        return parse_method if self.name == "method" else None


_Q_HELP = ("auto (default): on CPU 'mixed' for the target and 4-bit weights (w4a8) for the draft, full precision "
           "on a GPU or when --dtype is given; none: full precision; int8: int8 weights, float activations; w8a8: "
           "int8 weights and activations; w4a8: 4-bit weights, int8 activations; mixed: w4a8 for the weights a GGUF "
           "stores in 4 bits (Q4_K, Q4_0, ...), 6-bit weights for its Q6_K ones (as stored), w8a8 for the rest")

OPTIONS: tuple[Option, ...] = (
    # ---- models
    Option("model", "target model: a .gguf file, an HF directory or a repo id in the local HF cache",
           default="the built-in Qwen2.5-Coder-1.5B-Instruct", kwargs=("model_path",),
           flags=("--model", "-m", "--model-path"), metavar="TARGET", group="model"),
    Option("model",
           "draft model (.gguf or HF directory), 'ngram' for prompt lookup, or 'none' for no speculation",
           scope="speculative", default="the built-in Qwen2.5-Coder-0.5B draft with the built-in target, else none",
           kwargs=("speculative_model", "speculative_draft_model_path"), keys=("draft_model",),
           flags=("--speculative-model", "--speculative-draft-model-path", "-md", "--model-draft", "--draft-model"),
           metavar="DRAFT", group="model"),
    Option("method", "speculative method: draft_model (draft), ngram (prompt lookup), suffix, or none to decode "
           "without speculation; llama.cpp's --spec-type names (ngram-simple, ngram-mod, ...) are accepted",
           scope="speculative", parse=parse_method, default="draft_model with a draft model, else none",
           kwargs=("speculative_method", "speculative_algorithm"),
           flags=("--speculative-method", "--speculative-algorithm", "--spec-type"), metavar="METHOD",
           bench=False, group="model"),
    # ---- speculative decoding
    Option("num_speculative_tokens", "tokens drafted per step, 1..16; giving k fixes it (no --adaptive, no "
           "--ngram-first unless asked for)", scope="speculative", parse=int_at_least(1, MAX_SPEC_TOKENS),
           default="adaptive, up to 4 (draft model) or 12 (lookup)",
           kwargs=("num_speculative_tokens", "speculative_num_steps", "speculative_num_draft_tokens"),
           flags=("--num-speculative-tokens", "--speculative-num-steps", "--speculative-num-draft-tokens", "--draft",
                  "--draft-max", "--draft-n", "--spec-draft-n-max"),
           transforms={"speculative_num_draft_tokens": _sglang_num_draft_tokens,
                       "--speculative-num-draft-tokens": _sglang_num_draft_tokens},
           metavar="K", sweep=True, group="speculative"),
    Option("num_speculative_tokens_min", "llama.cpp's --draft-min (drop drafts shorter than N): not implemented, "
           "only 0 and 1 (no minimum) are accepted", scope="check", parse=int_at_least(0), default="0",
           kwargs=("speculative_num_draft_tokens_min",),
           flags=("--draft-min", "--draft-n-min", "--spec-draft-n-min"), metavar="N", bench=False,
           group="speculative"),
    Option("adaptive", "choose k per step (up to k) from the acceptance measured so far and the costs timed when "
           "the engine starts; k may drop to 0 where speculation does not pay", scope="speculative",
           default="on unless k is given", kwargs=("speculative_adaptive",),
           flags=("--adaptive", "--speculative-adaptive"), boolean=True, group="speculative"),
    Option("ngram_first", "with a draft model: prompt lookup where the context ends in an n-gram seen before, "
           "the draft model only elsewhere", scope="speculative", default="on unless k is given",
           kwargs=("speculative_ngram_first",), flags=("--ngram-first",), boolean=True, bench=False,
           group="speculative"),
    Option("prompt_lookup_num_tokens", "with ngram_first: the most tokens one lookup drafts, 1..16 (lookups cost "
           "no draft pass, so copied spans are verified deeper)", scope="speculative",
           parse=int_at_least(1, MAX_SPEC_TOKENS), sweep_parse=int_at_least(0, MAX_SPEC_TOKENS),
           default="12 (k when k is given)",
           kwargs=("prompt_lookup_num_tokens",),
           flags=("--prompt-lookup-num-tokens", "--ngram-draft"), metavar="N", sweep=True, group="speculative"),
    Option("prompt_lookup_max", "prompt lookup: longest context suffix to look up", scope="speculative",
           parse=int_at_least(1), default="4", kwargs=("ngram_prompt_lookup_max",), keys=("ngram_prompt_lookup_max",),
           flags=("--ngram-prompt-lookup-max", "--prompt-lookup-max", "--ngram-max"), metavar="N",
           group="speculative"),
    Option("prompt_lookup_min", "prompt lookup: shortest context suffix to look up", scope="speculative",
           parse=int_at_least(1), default="1; 3 with ngram_first", kwargs=("ngram_prompt_lookup_min",),
           keys=("ngram_prompt_lookup_min",),
           flags=("--ngram-prompt-lookup-min", "--prompt-lookup-min", "--ngram-min"), metavar="N",
           group="speculative"),
    Option("draft_p_min", "stop drafting once the draft model's top probability falls below P", scope="speculative",
           parse=float_in(0.0, 1.0, hi_open=True), default="0 (off)", kwargs=("speculative_draft_p_min",),
           flags=("--draft-p-min", "--speculative-draft-p-min", "--spec-draft-p-min"), metavar="P", sweep=True,
           group="speculative"),
    Option("draft_confidence", "stop drafting once the product of the draft model's top probabilities falls "
           "below C; k is then the cap", scope="speculative", parse=float_in(0.0, 1.0, hi_open=True),
           default="0 (off)", kwargs=("speculative_draft_confidence",),
           flags=("--draft-confidence", "--speculative-draft-confidence"), metavar="C", sweep=True,
           group="speculative"),
    Option("draft_vocab_size", "draft model: score only N frequent tokens plus special tokens and each request's "
           "own context (a cheaper draft step, the same output); 0 or none: the full head", scope="speculative",
           parse=_draft_vocab, default="auto: 32768 where a frequency ranking is known for the tokenizer",
           kwargs=("speculative_draft_vocab_size",), flags=("--draft-vocab-size", "--speculative-draft-vocab-size"),
           metavar="N", sweep=True, group="speculative"),
    Option("token_map", "draft model: a file of token ids, most frequent first (JSON, or SGLang's .pt), for "
           "draft_vocab_size; build one with 'specdecode token-map'", scope="speculative",
           default="the ranking shipped for the tokenizer", kwargs=("speculative_token_map",),
           keys=("speculative_token_map",), flags=("--speculative-token-map", "--token-map"), metavar="FILE",
           group="speculative"),
    Option("draft_window", "draft model: past this many tokens of context, the draft sees only the first 16 "
           "tokens (attention sinks) and the last N to 2N, re-indexed from position 0, so its prefill and steps stop "
           "growing with the prompt (the target still verifies everything: the output is unchanged); 0: the whole "
           "context", scope="speculative", parse=int_at_least(0), default="1024",
           kwargs=("speculative_draft_window",), flags=("--draft-window", "--speculative-draft-window"), metavar="N",
           group="speculative"),
    Option("quantization", "the draft model's weight format (a draft's precision only moves acceptance, never "
           "the output)", scope="speculative", parse=choice(*QUANTIZATIONS), choices=QUANTIZATIONS,
           default="auto: w4a8 with a quantized target, else the target's",
           kwargs=("speculative_model_quantization",), keys=("speculative_model_quantization",),
           flags=("--speculative-model-quantization", "-qd", "--quantization-draft"), group="speculative"),
    Option("disable_by_batch_size", "turn speculation off while at least N requests run", scope="speculative",
           parse=int_at_least(1), default="never", kwargs=("speculative_disable_by_batch_size",),
           keys=("speculative_disable_by_batch_size",), flags=("--speculative-disable-by-batch-size",),
           metavar="N", bench=False, group="speculative"),
    Option("suffix_decoding_max_tree_depth", "suffix: the longest match (and draft) the suffix index holds",
           scope="speculative", parse=int_at_least(1), default="24", kwargs=("suffix_decoding_max_tree_depth",),
           flags=("--suffix-decoding-max-tree-depth",), metavar="N", bench=False, group="speculative"),
    Option("suffix_decoding_max_cached_requests", "suffix: earlier requests kept in the index (0: only the "
           "current one)", scope="speculative", parse=int_at_least(0), default="10000",
           kwargs=("suffix_decoding_max_cached_requests",), flags=("--suffix-decoding-max-cached-requests",),
           metavar="N", bench=False, group="speculative"),
    Option("suffix_decoding_max_spec_factor", "suffix: draft at most F x the match length", scope="speculative",
           parse=float_in(0.0, 1e6), default="1.0", kwargs=("suffix_decoding_max_spec_factor",),
           flags=("--suffix-decoding-max-spec-factor",), metavar="F", bench=False, group="speculative"),
    Option("suffix_decoding_min_token_prob", "suffix: stop a draft at a token whose estimated probability is "
           "below P", scope="speculative", parse=float_in(0.0, 1.0), default="0.1",
           kwargs=("suffix_decoding_min_token_prob",), flags=("--suffix-decoding-min-token-prob",), metavar="P",
           bench=False, group="speculative"),
    # ---- engine
    Option("quantization", _Q_HELP, parse=choice(*QUANTIZATIONS), choices=QUANTIZATIONS, default="auto",
           flags=("--quantization", "-q")),
    Option("dtype", "float weight dtype (auto: float32 on CPU, bfloat16 on a GPU)", parse=choice(*DTYPES),
           choices=DTYPES, default="auto", flags=("--dtype",)),
    Option("kv_cache_dtype", "KV cache dtype: auto (16-bit on CPU, the model's dtype elsewhere), float16, bfloat16, "
           "float32, or int8 (alias q8_0: 8-bit values with a scale per position and KV head, about half the "
           "memory of 16-bit)", default="auto", flags=("--kv-cache-dtype",), bench=False),
    Option("max_model_len", "context length, prompt + output", parse=int_at_least(2),
           default="the model's trained context (32768 for the default pair)", kwargs=("context_length",),
           flags=("--max-model-len", "--context-length", "-c", "--ctx-size"), metavar="N"),
    Option("max_num_seqs", "requests running at once (KV cache slots)", parse=int_at_least(1),
           default="8 (1 for generate and chat)", kwargs=("max_running_requests",),
           flags=("--max-num-seqs", "--max-running-requests", "-np", "--parallel"), metavar="N", bench=False),
    Option("enable_prefix_caching", "reuse the KV blocks of prompt prefixes computed before, across requests "
           "(automatic prefix caching)", default="on", flags=("--enable-prefix-caching",), boolean=True,
           bench=False),
    Option("max_num_batched_tokens", "tokens one engine step computes: the running requests' verification rows, "
           "then chunks of new prompts up to this budget (chunked prefill)", parse=int_at_least(16),
           default="256", kwargs=("chunked_prefill_size",),
           flags=("--max-num-batched-tokens", "--chunked-prefill-size", "-b", "--batch-size"), metavar="N",
           bench=False),
    Option("kv_cache_memory", "KV cache budget in GiB, target and draft together (blocks are taken as tokens "
           "arrive; cached prefixes fill what is free)", parse=float_in(0.001, 1e6),
           default="address space for max_num_seqs x max_model_len, RAM as positions are held", flags=("--kv-cache-memory",), metavar="GiB",
           bench=False),
    Option("max_waiting_requests", "waiting-queue limit; beyond it requests are refused (HTTP 503)",
           parse=int_at_least(1), default="256", flags=("--max-waiting-requests",), metavar="N", bench=False),
    Option("seed", "random seed", parse=int_at_least(0, 2 ** 64 - 1), default="0", kwargs=("random_seed",),
           flags=("--seed", "-s", "--random-seed"), metavar="N"),
    Option("device", "cpu, cuda or cuda:N", default="auto: cuda when available", flags=("--device",),
           bench=False),
    Option("num_threads", "CPU threads for torch", parse=int_at_least(1), default="torch's choice",
           kwargs=("threads",), flags=("--threads", "-t", "--num-threads"), metavar="N"),
    Option("compile", "torch.compile the decode / verification layers where they run in Python (GPU, or model "
           "families without the fused CPU layer stack)", default="off", flags=("--compile",), boolean=True),
    # ---- server
    Option("tool_call_parser", "serve: how tool calls are read from the model's output into OpenAI tool_calls, "
           "and enforced for tool_choice required / named (vLLM's flag): hermes (`<tool_call>{json}</tool_call>`, "
           "Qwen2.5 / Qwen3 / Hermes); auto: hermes", scope="server", parse=choice(*tool_parser_names()),
           choices=tool_parser_names(), default="auto", flags=("--tool-call-parser",), group="server"),
    Option("webui", "serve: the web chat page at / (--no-webui: the API only)", scope="server", default="on",
           flags=("--webui",), boolean=True, group="server"),
    Option("request_head_timeout", "serve: seconds a connection has to send a whole request line and headers "
           "(from connecting, or from its last response); then it is closed, with HTTP 408 if part of a head came",
           scope="server", parse=float_in(0.0, lo_open=True), default="10", flags=("--request-head-timeout",),
           metavar="SECONDS", group="server"),
    Option("timeout_keep_alive", "serve: seconds an idle keep-alive connection stays open between requests "
           "(uvicorn's setting)", scope="server", parse=float_in(0.0, lo_open=True), default="5",
           flags=("--timeout-keep-alive",), metavar="SECONDS", group="server"),
    Option("max_connections", "serve: open connections; beyond it the one idle the longest is closed, and a new "
           "one gets HTTP 503 with Retry-After only when every connection has a request in progress", scope="server",
           parse=int_at_least(1), default="1024", flags=("--max-connections",), metavar="N", group="server"),
    Option("max_request_head_bytes", "serve: size of a request line and headers; larger gets HTTP 431",
           scope="server", parse=int_at_least(1024), default="32768", flags=("--max-request-head-bytes",),
           metavar="BYTES", group="server"),
)

# vLLM options that do not apply to this engine: accepted with a warning so that vLLM code runs unchanged.
IGNORED_VLLM = {
    "tensor_parallel_size": "this engine runs on one device",
    "gpu_memory_utilization": "the KV cache is sized by kv_cache_memory (GiB)",
    "enforce_eager": "nothing is captured as CUDA graphs; see compile",
    "trust_remote_code": "no remote code is ever run: models use the built-in implementations",
}
NOT_SUPPORTED = {
    "tokenizer": "the tokenizer always comes from the model (its HF directory or its GGUF file)",
}

ENGINE_OPTIONS = tuple(o for o in OPTIONS if o.scope == "engine")
SPECULATIVE_OPTIONS = tuple(o for o in OPTIONS if o.scope in ("speculative", "check"))
_BY_KEYWORD: dict[str, Option] = {k: o for o in OPTIONS for k in o.keywords}
_BY_KEY: dict[str, Option] = {k: o for o in SPECULATIVE_OPTIONS if o.scope == "speculative"
                              for k in (o.name,) + o.keys}


def _unknown(kind: str, name: str, known: list[str], listing: bool = False) -> ValueError:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    tail = f"; valid {kind}s are {sorted(known)}" if listing else "; `specdecode options` lists them all"
    return ValueError(f"Unknown {kind} {name!r}{hint}{tail}.")


def _put(dest: dict, origin: dict, opt: Option, spelling: str, value: Any) -> None:
    value = opt.transforms.get(spelling, lambda v: v)(value)
    if opt.convert is not None:
        value = opt.convert(value)
    if opt.name in dest and dest[opt.name] != value:
        raise ValueError(f"{origin[opt.name]}={dest[opt.name]!r} and {spelling}={value!r} set the same option "
                         f"({opt.name}) to different values; pass one.")
    dest[opt.name] = value
    origin[opt.name] = spelling


def _check_only(opt: Option, value: Any, spelling: str) -> None:
    if opt.name == "num_speculative_tokens_min" and value not in (0, 1):
        raise ValueError(f"{spelling}={value!r}: dropping drafts shorter than a minimum is not implemented; "
                         "use draft_p_min or draft_confidence to stop weak drafts, or adaptive k.")


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """Keyword arguments -> (EngineConfig fields, SpeculativeConfig fields given as top-level keywords,
    speculative_config). Aliases map to one name; None means not given; unknown names raise one error with
    the close matches; vLLM options that do not apply here are accepted with a warning."""
    engine: dict[str, Any] = {}
    spec: dict[str, Any] = {}
    origin: dict[str, str] = {}
    spec_origin: dict[str, str] = {}
    sc = None
    for name, value in kwargs.items():
        if name == "speculative_config":
            sc = value
            continue
        if name in IGNORED_VLLM:
            if name == "tensor_parallel_size" and value not in (None, 1):
                raise ValueError(f"tensor_parallel_size={value!r}: this engine runs on one device; pass 1 or "
                                 "leave it out.")
            logger.warning("%s=%r has no effect here (%s); accepted for vLLM compatibility.", name, value,
                           IGNORED_VLLM[name])
            continue
        if name in NOT_SUPPORTED:
            if value is None:
                continue
            raise ValueError(f"{name}={value!r} is not supported: {NOT_SUPPORTED[name]}.")
        opt = _BY_KEYWORD.get(name)
        if opt is None:
            known = list(_BY_KEYWORD) + list(IGNORED_VLLM) + ["speculative_config"]
            raise _unknown("option", name, known)
        if value is None:
            continue
        if opt.scope == "check":
            _check_only(opt, value, name)
        elif opt.scope == "engine":
            _put(engine, origin, opt, name, value)
        else:
            _put(spec, spec_origin, opt, name, value)
    return engine, spec, sc


def speculative_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The keys of a ``speculative_config`` dict -> SpeculativeConfig fields (aliases resolved)."""
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in config.items():
        opt = _BY_KEY.get(key)
        if opt is None:
            raise _unknown("speculative_config key", key, sorted({o.name for o in _BY_KEY.values()}), listing=True)
        if value is not None:
            _put(out, origin, opt, key, value)
    return out


# ---------------------------------------------------------------- command line
def json_object_arg(text: str | None, flag: str) -> dict | None:
    """A flag's JSON-object value -> the dict (None when not given); ValueError naming the flag otherwise."""
    import json

    if not text:
        return None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}.")
    return cfg


def speculative_config_json(text: str | None) -> dict | None:
    """``--speculative-config JSON`` -> the dict (None when not given); ValueError for anything but an object."""
    return json_object_arg(text, "--speculative-config")


def _argtype(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def wrapped(s: str) -> Any:
        try:
            return parse(s)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    wrapped.__name__ = getattr(parse, "__name__", "value")
    return wrapped


def _dest(opt: Option) -> str:
    return f"{opt.scope}.{opt.name}"


def _help(opt: Option) -> str:
    return f"{opt.help} (default: {opt.default})" if opt.default else opt.help


GROUP_TITLES = {"model": "models", "speculative": "speculative decoding", "engine": "engine"}


def add_options(parser: argparse.ArgumentParser, command: str, skip: tuple[str, ...] = (),
                groups: dict[str, Any] | None = None) -> None:
    """Adds the table's flags to a subcommand's parser, and --speculative-config (vLLM's JSON form) beside them.
    Every default is None (not given: the preset decides); with command='bench', sweepable options take
    comma-separated lists."""
    groups = {} if groups is None else groups
    for opt in OPTIONS:
        if opt.name in skip and opt.scope == "engine" or (command == "bench" and not opt.bench):
            continue
        if opt.scope == "server" and command != "serve":
            continue
        if f"{opt.scope}.{opt.name}" in skip:
            continue
        g = groups.get(opt.group)
        if g is None:
            g = groups[opt.group] = parser.add_argument_group(GROUP_TITLES[opt.group])
        sweep = command == "bench" and opt.sweep
        flags = [f for f in opt.flags if f not in opt.transforms]
        if opt.boolean:
            g.add_argument(*flags, dest=_dest(opt), action=argparse.BooleanOptionalAction, default=None,
                           help=_help(opt))
            continue
        parse = list_of(opt.sweep_parse or opt.parse) if sweep else opt.parse
        metavar = opt.metavar or ("{" + ",".join(opt.choices) + "}" if opt.choices else opt.name.upper())
        metavar = f"{metavar},{metavar}" if sweep else metavar
        g.add_argument(*flags, dest=_dest(opt), type=_argtype(parse), default=None, metavar=metavar,
                       help=_help(opt) + ("; one config per value" if sweep else ""))
        for spelling, fn in opt.transforms.items():
            if spelling.startswith("-"):
                one = opt.parse
                conv = ((lambda f, one=one: lambda s: [f(v) for v in list_of(one)(s)])(fn) if sweep
                        else (lambda f, one=one: lambda s: f(one(s)))(fn))
                g.add_argument(spelling, dest=_dest(opt), type=_argtype(conv), default=None, metavar=metavar,
                               help=f"the same as {flags[0]} + 1 (SGLang counts the verified token)")
    if command != "bench":  # bench sweeps the separate flags instead
        groups["speculative"].add_argument(
            "--speculative-config", default=None, metavar="JSON",
            help='the speculative options as one JSON object (vLLM), e.g. \'{"method": "ngram", '
                 '"num_speculative_tokens": 4}\'; instead of the separate speculative flags')


def flag_values(args: argparse.Namespace) -> dict[Option, Any]:
    """The table options given on the command line, with their parsed values."""
    out = {}
    for opt in OPTIONS:
        v = getattr(args, _dest(opt), None)
        if v is not None:
            out[opt] = v
    return out


def kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Engine keyword arguments from the flags given (the preset fills the rest); ValueError for a malformed
    --speculative-config."""
    kw: dict[str, Any] = {}
    for opt, v in flag_values(args).items():
        if opt.scope == "check":
            _check_only(opt, v, opt.name)
        elif opt.scope == "server":
            continue  # read by the server itself, not the engine
        elif opt.scope == "engine":
            kw[opt.name] = v
        else:
            kw[opt.kwargs[0]] = v
    sc = speculative_config_json(getattr(args, "speculative_config", None))
    if sc is not None:
        kw["speculative_config"] = sc
    return kw


def flag_names(message: str, used: dict[str, str] | None = None) -> str:
    """An engine error message with option names replaced by the flags that set them (the spelling the user
    typed when known), so that a command-line user reads their own flags."""
    import re

    used = used or {}
    names: dict[str, str] = {}
    for opt in SPECULATIVE_OPTIONS:
        flag = used.get(_dest(opt)) or opt.flags[0]
        for n in (opt.name,) + opt.kwargs:
            if "_" in n and n != "draft_model":  # identifiers only: plain words like 'model' stay words
                names.setdefault(n, flag)
    pattern = re.compile(r"(?<![\w-])(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")(?![\w-])")
    return pattern.sub(lambda m: names[m.group(1)], message)


def used_spellings(argv: list[str]) -> dict[str, str]:
    """dest -> the spelling of each table flag as typed in argv."""
    typed = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    out = {}
    for opt in OPTIONS:
        for f in opt.flags:
            if f in typed or ("--no-" + f[2:]) in typed:
                out.setdefault(_dest(opt), f)
    return out


# ---------------------------------------------------------------- sampling flags
@dataclass(frozen=True)
class SamplingFlag:
    flags: tuple[str, ...]
    help: str
    parse: Callable[[str], Any] | None = None  # None: a switch
    default: Any = None
    metavar: str | None = None


# The sampling flags, declared once: generate and chat take them all; bench (greedy by default, compared with
# its baseline) and bench serve (sent with every request) take some, with their own defaults and help.
SAMPLING_FLAGS: dict[str, SamplingFlag] = {
    "temperature": SamplingFlag(("--temp", "--temperature"), "sampling temperature; 0 = greedy (default 0)",
                                float_in(0.0), 0.0, "T"),
    "top_p": SamplingFlag(("--top-p",), "nucleus sampling threshold in (0, 1] (default 1 = off)",
                          float_in(0.0, 1.0, lo_open=True), 1.0, "P"),
    "top_k": SamplingFlag(("--top-k",), "keep only the K most likely tokens (default -1 = off)", int_at_least(-1),
                          -1, "K"),
    "min_p": SamplingFlag(("--min-p",), "drop tokens below P x the top probability (default 0 = off)",
                          float_in(0.0, 1.0), 0.0, "P"),
    "repetition_penalty": SamplingFlag(("--repeat-penalty", "--repetition-penalty"),
                                       "repetition penalty (default 1 = off)", float_in(0.0, lo_open=True), 1.0, "R"),
    "ignore_eos": SamplingFlag(("--ignore-eos",), "keep generating past the end-of-sequence token"),
}


def add_sampling_flags(group: Any, names: tuple[str, ...] = tuple(SAMPLING_FLAGS),
                       defaults: dict[str, Any] | None = None, helps: dict[str, str] | None = None) -> None:
    """Adds the sampling flags ``names`` (dest: the SamplingParams field) to an argument group; ``defaults`` and
    ``helps`` replace the table's, per name."""
    defaults, helps = defaults or {}, helps or {}
    for name in names:
        f = SAMPLING_FLAGS[name]
        if f.parse is None:
            group.add_argument(*f.flags, dest=name, action="store_true", help=helps.get(name, f.help))
        else:
            group.add_argument(*f.flags, dest=name, type=f.parse, default=defaults.get(name, f.default),
                               metavar=f.metavar, help=helps.get(name, f.help))


# ---------------------------------------------------------------- reference
def markdown_table() -> str:
    """The option reference (docs/options.md, `specdecode options`)."""
    lines = ["# Options", "",
             "Generated from `specdecode/options.py` (`specdecode options`). Python keywords go to `LLM(...)`, "
             "`Engine(...)` and `LLMEngine.from_kwargs(...)`; speculative options also go inside "
             "`speculative_config={...}` under their name. The same flags work in `generate`, `chat`, `serve` "
             "and (where marked) `bench`. Unset options take the `fast` preset (`specdecode/presets.py`).", "",
             "| option | Python keywords | flags | default | what it does |", "|---|---|---|---|---|"]
    for o in OPTIONS:
        py = ", ".join(f"`{k}`" for k in ((o.name,) if o.scope == "speculative" else ()) + o.keywords + o.keys)
        flags = ", ".join(f"`{f}`" for f in o.flags) + (" (`--no-` to turn off)" if o.boolean else "")
        where = "" if o.bench else " Not in bench."
        name = f"`{o.name}`" + {"speculative": " (speculative)", "server": " (serve only)"}.get(o.scope, "")
        lines.append(f"| {name} | {py} | {flags} | {o.default} | {o.help}.{where} |")
    lines += ["", "vLLM options accepted with a warning, without effect: "
              + ", ".join(f"`{k}` ({v})" for k, v in IGNORED_VLLM.items()) + ".", ""]
    return "\n".join(lines)
