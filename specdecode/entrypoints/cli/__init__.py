"""The ``specdecode`` command: generate, chat, bench, serve, token-map and options, one module each.

    specdecode generate -p "Write a haiku"                     (the fast default pair, chat template applied)
    specdecode chat                                            (interactive)
    specdecode bench --dataset spec_bench_questions.jsonl      (speculative vs. plain)
    specdecode bench serve --base-url URL --dataset FILE       (any running OpenAI-compatible server)
    specdecode serve                                           (OpenAI-compatible server)
    specdecode options                                         (every engine and speculative option)

User errors (a missing file, a bad flag value, anything the engine rejects with ValueError) print one line,
``error: ...``, on stderr and exit with code 2.
"""
from __future__ import annotations

import logging
import os
import sys

from specdecode import startup
from specdecode.entrypoints.cli import bench, chat, generate, serve, token_map
from specdecode.entrypoints.cli._shared import EXIT_USAGE, CLIError, Formatter, Parser, one_line

__all__ = ["main", "build_parser", "CLIError"]

_EPILOG = """\
examples:
  specdecode generate -p "Write a haiku about autumn"                 fast defaults, chat template
  specdecode generate -m target.gguf -md draft.gguf -p "..." -n 256
  specdecode generate -m model_dir --spec-type ngram -f prompt.txt
  specdecode generate --spec-type none -q none -p "..."               plain decoding, full precision
  specdecode chat --temp 0.7
  specdecode bench --dataset spec_bench_questions.jsonl --num-prompts 2 --max-tokens 16 \\
                   --method ngram,draft --k 2,4 --output-json bench.json --plot plots/
  specdecode serve --port 8000
  specdecode bench serve --base-url http://127.0.0.1:8000 --dataset spec_bench_questions.jsonl \\
                   --max-concurrency 1,4 --result-json serve.json --plot serve.png
  specdecode options                                                  every option and its spellings

Run 'specdecode COMMAND --help' for the flags of a command."""


_LOAD_ENGINE = ("generate", "chat", "serve", "bench")  # the commands whose start-up is an engine load


def _options(args) -> int:
    from specdecode.options import markdown_table

    sys.stdout.write(markdown_table())
    return 0


def build_parser() -> Parser:
    from specdecode import __version__

    parser = Parser(prog="specdecode", formatter_class=Formatter, epilog=_EPILOG,
                    description="Speculative-decoding LLM inference: a cheap draft (a small model or n-gram "
                                "lookup in the context) proposes tokens, the target verifies them in one pass. "
                                "Greedy output is identical to plain decoding.")
    parser.add_argument("-V", "--version", action="version", version=f"specdecode {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for module in (generate, chat, bench, token_map, serve):
        module.add_parser(sub)
    bench.add_serve_parser(sub)
    o = sub.add_parser("options", formatter_class=Formatter, help="list every engine and speculative option",
                       description="Print the option table (Markdown): each option's Python keywords, its flags in "
                                   "generate, chat, serve and bench, its default and what it does.")
    o.set_defaults(func=_options)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time, so a replaced or closed stream is never kept."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _lower_level(record: logging.LogRecord) -> bool:
    record.levelname_lower = record.levelname.lower()
    return True


def _setup_logging(verbose: bool) -> None:
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname_lower)s: %(message)s"))
    handler.addFilter(_lower_level)
    root = logging.getLogger("specdecode")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    root.propagate = False


def _flush_quietly() -> None:
    try:
        sys.stdout.flush()
    except Exception:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if command is not None and argv[command:command + 2] == ["bench", "serve"]:
        argv[command:command + 2] = ["bench-serve"]  # `bench serve` is its own parser: `bench` keeps its flags
    for name, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
        if getattr(sys, name) is None:  # started with the descriptor closed (`<&-`): read as empty, write to nowhere
            setattr(sys, name, open(os.devnull, mode))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    args = None
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version, or a usage error already printed
            return e.code if isinstance(e.code, int) else EXIT_USAGE
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        _setup_logging(args.verbose)
        if args.command in _LOAD_ENGINE:
            startup.pause()  # until the engine is loaded (startup.py); the finally below is the backstop
        return args.func(args) or 0
    except BrokenPipeError:  # e.g. `specdecode generate ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (CLIError, ValueError) as e:
        _flush_quietly()
        from specdecode.options import flag_names, used_spellings
        print(f"error: {flag_names(one_line(e), used_spellings(argv))}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, RuntimeError) as e:  # unreadable or unwritable files; memory the engine could not get
        from specdecode.entrypoints.openai.cli_args import is_out_of_memory, out_of_memory_message
        if is_out_of_memory(e):  # the KV cache, allocated at load, sized by the flags
            from specdecode.options import kwargs_from_args
            _flush_quietly()
            print(f"error: {out_of_memory_message(kwargs_from_args(args) if args is not None else {})}",
                  file=sys.stderr)
            return EXIT_USAGE
        if isinstance(e, RuntimeError):
            raise
        _flush_quietly()
        where = f" {e.filename}" if getattr(e, "filename", None) else ""
        print(f"error:{where} {e.strerror or e}" if where else f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        _flush_quietly()
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        startup.resume()


if __name__ == "__main__":
    sys.exit(main())
