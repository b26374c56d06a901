"""``specdecode chat``: an interactive conversation in the terminal (llama-cli's conversation mode)."""
from __future__ import annotations

import sys

from specdecode import options
from specdecode.entrypoints.cli._shared import (OPT_OUTS, CLIError, Formatter, Interrupt, add_sampling_flags,
                                                describe, engine_kwargs, fmt, load_engine, sampling_params, stats,
                                                stream)

HELP = "Commands: /exit (or Ctrl-D) quits, /reset clears the history, /help shows this"


def add_parser(sub) -> None:
    c = sub.add_parser("chat", formatter_class=Formatter, help="interactive chat in the terminal",
                       description="Chat with the model in the terminal. History is kept and the model's chat "
                                   "template applied (--raw: each line is continued as plain text, no history); "
                                   f"replies stream, and a stats line follows each one. {HELP}; Ctrl-C during a "
                                   f"reply stops that reply only. {OPT_OUTS}.")
    c.add_argument("--system", default=None, metavar="TEXT", help="system message")
    c.add_argument("--raw", "-no-cnv", "--no-conversation", dest="raw", action="store_true",
                   help="plain completion of each line, without the chat template or history")
    options.add_options(c, "chat")
    add_sampling_flags(c, 512)
    c.set_defaults(func=run)


def _read_line(interactive: bool) -> str | None:
    if interactive:
        try:
            return input("> ")
        except EOFError:
            return None
    line = sys.stdin.readline()
    return None if line == "" else line


def _encode(engine, system: list[dict], history: list[dict], raw: bool) -> list[int] | None:
    """The prompt ids for the conversation so far, forgetting the oldest exchanges until it fits."""
    from specdecode.tokenizer import apply_chat_template

    while True:
        try:
            text = history[-1]["content"] if raw else apply_chat_template(engine.tokenizer, system + history)
            ids = engine.input_processor.encode_prompt(text)
            if len(ids) + 1 >= engine.max_model_len:
                raise ValueError("too long")
            return ids
        except ValueError:
            if len(history) <= 1:
                history.clear()
                print("error: this message does not fit the context (max_model_len "
                      f"{engine.max_model_len}); send a shorter one", file=sys.stderr)
                return None
            del history[:2]  # forget the oldest exchange


def run(args) -> int:
    params = sampling_params(args)
    engine = load_engine(engine_kwargs(args, max_num_seqs=1))
    if not args.raw and not getattr(engine.tokenizer, "chat_template", None):
        raise CLIError(f"{engine.model_path} has no chat template; pass --raw for plain completion")
    target, draft, k = describe(engine)
    interactive = sys.stdin.isatty()
    print(f"specdecode chat: target {target}, draft {draft}" + (f" (k={k})" if k else "")
          + f", loaded in {engine.load_time:.1f} s\n{HELP}", file=sys.stderr)
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
            print(HELP, file=sys.stderr)
            continue
        history.append({"role": "user", "content": msg})
        ids = _encode(engine, system, history, args.raw)
        if ids is None:
            continue
        room = engine.max_model_len - len(ids)
        p = params.clone(max_tokens=room if params.max_tokens is None else min(params.max_tokens, room),
                         seed=None if params.seed is None else params.seed + turn)
        with Interrupt() as intr:
            result = stream(engine, f"chat-{turn}", ids, p, sys.stdout, intr)
        turn += 1
        reply = result["output"].outputs[0].text
        sys.stdout.write("\n")
        sys.stdout.flush()
        if args.raw:
            history.clear()
        else:
            history.append({"role": "assistant", "content": reply})
        s = stats(engine, result)
        parts = [f"{s['n_predict']} tokens", f"prefill {fmt(s['prompt_tokens_per_s'], '.1f')} t/s",
                 f"decode {fmt(s['decode_tokens_per_s'], '.1f')} t/s"]
        if s["n_draft"]:
            parts.append(f"accept {fmt(None if s['accept_rate'] is None else 100 * s['accept_rate'], '.0f')}%")
            parts.append(f"mean len {fmt(s['mean_acceptance_length'], '.2f')}")
        if result["aborted"]:
            parts.append("interrupted")
        print("[" + " | ".join(parts) + "]", file=sys.stderr, flush=True)
    return 0
