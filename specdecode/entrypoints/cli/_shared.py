"""What the subcommands share: one-line errors, the argparse classes, the sampling flags, engine keyword
arguments from the flags (the option table's, added by specdecode.options.add_options), loading an engine and
streaming one request with its statistics."""
from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import Any

from specdecode import options
from specdecode.models.context import check_max_model_len
from specdecode.parsers import int_at_least

EXIT_USAGE = 2


class CLIError(Exception):
    """A user error: printed as one ``error: ...`` line, exit code 2."""


def one_line(msg: object) -> str:
    return " ".join(str(msg).split()) or "unknown error"


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``error: ...``) and exit code 2, not the whole usage block."""

    def error(self, message: str):  # noqa: D401 (argparse API)
        if message.startswith("unrecognized arguments:"):
            message += _close_flags(self, message.split(":", 1)[1].split())
        self.exit(EXIT_USAGE, f"error: {one_line(message)} (see '{self.prog} --help')\n")


def _close_flags(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """' (did you mean ...?)' for mistyped flags, searched in the parser and all its subcommands."""
    import difflib

    known: set[str] = set()
    todo = [parser]
    while todo:
        p = todo.pop()
        for a in p._actions:
            known.update(a.option_strings)
            if isinstance(a, argparse._SubParsersAction):
                todo.extend(a.choices.values())
    close = [m for u in unknown if u.startswith("-")
             for m in difflib.get_close_matches(u.split("=", 1)[0], sorted(known), n=2, cutoff=0.75)]
    return f" (did you mean {' or '.join(dict.fromkeys(close))}?)" if close else ""


class Formatter(argparse.HelpFormatter):
    """Wraps one-paragraph descriptions; text with explicit line breaks (examples) is kept as written."""

    def __init__(self, prog: str):
        import shutil
        super().__init__(prog, max_help_position=34, width=min(100, shutil.get_terminal_size((100, 24)).columns))

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        import re
        import textwrap
        # A flag and its value (-q none, --draft K) stay on one line, and a flag is never cut at its hyphens, so
        # every opt-out the text names can be copied from it (textwrap breaks at ASCII whitespace only).
        glued = re.sub(r"(?<!\S)(-[\w-]+) (\S+)", "\\1\xa0\\2", " ".join(text.split()))
        return textwrap.fill(glued, width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False).replace("\xa0", " ")


OPT_OUTS = ("The defaults are the 'fast' preset: mixed target (a GGUF's Q4_K / Q6_K blocks as stored, else w8a8), "
            "4-bit draft (w4a8), prompt lookup first, "
            "adaptive k, truncated draft head. Opt out part by part: -q none (full precision), --spec-type none "
            "(no speculation), --no-adaptive, --no-ngram-first, --draft-vocab-size 0; --draft K fixes k")


# ---------------------------------------------------------------- argument types
def max_tokens_arg(s: str) -> int | None:
    """-n N: N >= 1 tokens, or -1 for no limit but the context (llama.cpp's spelling)."""
    if s.strip() == "-1":
        return None
    return int_at_least(1)(s)


def add_sampling_flags(p: argparse.ArgumentParser, n_default: int) -> None:
    """-n and the sampling flags of options.SAMPLING_FLAGS."""
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--n-predict", "--max-tokens", dest="max_tokens", type=max_tokens_arg, default=n_default,
                   metavar="N", help=f"maximum tokens to generate; -1 = until the context is full (default {n_default})")
    options.add_sampling_flags(g)


def sampling_params(args, max_tokens: int | None = None):
    from specdecode.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k if args.top_k else -1,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          max_tokens=max_tokens or args.max_tokens, ignore_eos=args.ignore_eos,
                          seed=None if args.temperature == 0 else seed_of(args))


def seed_of(args) -> int:
    v = getattr(args, "engine.seed", None)
    return 0 if v is None else v


# ---------------------------------------------------------------- paths and engine kwargs
def resolve_user_path(path: str, role: str) -> str:
    """Fails fast on a missing model path (before the other model spends seconds loading)."""
    from specdecode.models.resolve import resolve_model

    return str(resolve_model(path, role))


def user_file(path: str, flag: str) -> str:
    p = Path(path).expanduser()
    if not p.is_file():
        raise CLIError(f"{flag} {path}: no such file")
    return str(p)


def engine_kwargs(args, **defaults: Any) -> dict:
    """Engine keyword arguments from the flags given (plus ``defaults`` for options not given); model paths
    are checked before anything loads."""
    kw = options.kwargs_from_args(args)
    for k, v in defaults.items():
        kw.setdefault(k, v)
    if kw.get("model") is not None:
        kw["model"] = resolve_user_path(kw["model"], "target")
    draft = kw.get("speculative_model")
    if isinstance(draft, str) and draft.strip().lower() not in options.NO_DRAFT + options.NGRAM_MODELS + ("default",):
        kw["speculative_model"] = resolve_user_path(draft, "draft")
    if kw.get("speculative_token_map"):
        kw["speculative_token_map"] = user_file(kw["speculative_token_map"], "--token-map")
    check_max_model_len(kw)
    return kw


def build_config(kw: dict):
    """EngineConfig.from_kwargs; its ValueErrors name options, which ``main`` turns into the flags typed."""
    from specdecode.config import EngineConfig

    return EngineConfig.from_kwargs(**kw)


def load_engine(kw: dict):
    from specdecode.engine.llm_engine import LLMEngine

    return LLMEngine(build_config(kw))


def describe(engine) -> tuple[str, str, int]:
    """(target, draft description, k) of a loaded engine."""
    spec = engine.config.speculative
    if spec is None:
        return str(engine.model_path), "none", 0
    if spec.method != "draft_model":
        return str(engine.model_path), f"{spec.method} (n={spec.prompt_lookup_min}..{spec.prompt_lookup_max})" \
            if spec.method == "ngram" else spec.method, spec.num_speculative_tokens
    draft = str(getattr(engine, "draft_path", spec.model))
    extra = [x for x, on in (("lookup first", spec.ngram_first), ("adaptive", spec.adaptive)) if on]
    return str(engine.model_path), draft + (f" ({', '.join(extra)})" if extra else ""), spec.num_speculative_tokens


# ---------------------------------------------------------------- streaming one request
class Interrupt:
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


def stream(engine, rid: str, ids: list[int], params, out, interrupt: Interrupt | None = None) -> dict:
    """Runs one request to the end, writing text deltas to ``out``; returns the output and its timings
    (request added, first token, last token)."""
    printed = ""
    t0 = time.perf_counter()
    engine.add_request(rid, None, params, prompt_token_ids=ids)
    t_first = final = None
    aborted = False
    while final is None:
        if interrupt is not None and interrupt.hit and not aborted:
            engine.abort_request(rid)
            aborted = True
        outs = engine.step()
        now = time.perf_counter()
        mine = next((o for o in outs if o.request_id == rid), None)
        if mine is None:
            if not engine.has_unfinished_requests():
                raise RuntimeError("the engine stopped without finishing the request")
            continue
        if t_first is None and mine.outputs[0].token_ids:
            t_first = now
        text = mine.outputs[0].text
        if out is not None and text.startswith(printed) and len(text) > len(printed):
            out.write(text[len(printed):])
            out.flush()
            printed = text
        if mine.finished:
            final = mine
    return {"output": final, "t0": t0, "t_first": now if t_first is None else t_first, "t_end": now,
            "aborted": aborted}


def stats(engine, run: dict) -> dict:
    o = run["output"]
    c = o.outputs[0]
    spec = o.metrics.spec_decode if o.metrics is not None else None
    target, draft, k = describe(engine)
    n_prompt, n_out = len(o.prompt_token_ids), len(c.token_ids)
    t_prefill = run["t_first"] - run["t0"]
    t_decode = max(0.0, run["t_end"] - run["t_first"])
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
        "ttft_s": t_prefill,
        "total_time_s": run["t_end"] - run["t0"],
        "load_time_s": engine.load_time,
        "finish_reason": c.finish_reason,
    }


def fmt(v, spec=".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def format_stats(s: dict) -> str:
    lines = [
        "",
        f"target:   {s['target']}",
        f"draft:    {s['draft']}" + (f" (k={s['n_draft']})" if s["n_draft"] else ""),
        f"encoded {s['n_prompt']:5d} tokens in {s['prompt_time_s']:8.3f} s, speed: "
        f"{fmt(s['prompt_tokens_per_s'], '8.2f')} t/s   (prompt, until the first token)",
        f"decoded {s['decode_tokens']:5d} tokens in {s['decode_time_s']:8.3f} s, speed: "
        f"{fmt(s['decode_tokens_per_s'], '8.2f')} t/s   (after the first token)",
        "",
        f"n_draft   = {s['n_draft']}",
        f"n_predict = {s['n_predict']}",
        f"n_drafted = {s['n_drafted']}",
        f"n_accept  = {s['n_accept']}",
        "accept    = " + ("n/a" if s["accept_rate"] is None else f"{100 * s['accept_rate']:.3f}%"),
        f"mean acceptance length = {fmt(s['mean_acceptance_length'])} (tokens per target pass; "
        f"{s['n_drafts']} verification passes with drafts)",
        f"load time = {s['load_time_s']:.3f} s",
    ]
    return "\n".join(lines)
