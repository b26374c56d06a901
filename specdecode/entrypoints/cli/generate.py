"""``specdecode generate``: one prompt, streamed to stdout, statistics to stderr (llama-cli / llama-speculative)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from specdecode import options
from specdecode.entrypoints.cli._shared import (OPT_OUTS, CLIError, Formatter, add_sampling_flags, engine_kwargs,
                                                format_stats, load_engine, sampling_params, stats, stream)

DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."


def add_parser(sub) -> None:
    g = sub.add_parser("generate", formatter_class=Formatter, help="generate text from a prompt (llama-cli style)",
                       description="Generate from one prompt with speculative decoding and stream the text to "
                                   "stdout; statistics (acceptance, prefill and decode speed, load time) go to "
                                   "stderr. The prompt is sent as a user message in the model's chat template "
                                   "when it has one (--raw: plain completion). " + OPT_OUTS + ".",
                       epilog="examples:\n  specdecode generate -p 'Write a haiku about autumn'\n"
                              "  specdecode generate --raw -p 'def fib(n):' -n 64\n"
                              "  specdecode generate -m target.gguf -md draft.gguf -p '...' -n 256\n"
                              "  specdecode generate -m model_dir --spec-type ngram -f prompt.txt --json\n"
                              "  specdecode generate -f before.py --suffix-file after.py --echo\n"
                              "  specdecode generate -p 'Extract the person as JSON: ...' --json-schema person.json")
    gi = g.add_argument_group("input and output")
    gi.add_argument("-p", "--prompt", default=None, help=f"the prompt (default: {DEFAULT_PROMPT!r})")
    gi.add_argument("-f", "--file", metavar="PROMPT_FILE", default=None, help="read the prompt from a file ('-' = stdin)")
    gi.add_argument("--raw", "-no-cnv", "--no-conversation", dest="raw", action="store_true",
                    help="plain completion: the prompt as it is, without the chat template")
    gi.add_argument("--chat", action="store_true",
                    help="require the chat template (the default when the model has one): an error if it has none")
    gi.add_argument("--system", default=None, metavar="TEXT", help="system message (chat template only)")
    gi.add_argument("--echo", action="store_true",
                    help="print the prompt before the generated text (--raw; with --suffix, the suffix after it)")
    gi.add_argument("--json", action="store_true",
                    help="print one JSON object (text, token ids, stats) to stdout instead of streaming")
    gs = gi.add_mutually_exclusive_group()
    gs.add_argument("--suffix", metavar="TEXT", default=None,
                    help="fill in the middle: the prompt is the text before the gap and TEXT the text after it "
                         "(code models trained for it, as the default Qwen2.5-Coder; no chat template; an empty "
                         "TEXT: plain completion)")
    gs.add_argument("--suffix-file", metavar="FILE", default=None, help="--suffix read from a file")
    gi.add_argument("--prediction", metavar="FILE", default=None,
                    help="text the answer will mostly repeat, e.g. a file to edit (OpenAI's predicted outputs): "
                         "lookups draft from it first; the answer stays the model's own")
    gc = g.add_argument_group("structured output (llama.cpp's flags)")
    gx = gc.add_mutually_exclusive_group()
    gx.add_argument("-j", "--json-schema", "--json-schema-file", dest="json_schema", metavar="FILE", default=None,
                    help="constrain the output to JSON valid under the JSON schema in FILE (or given inline, "
                         "as llama.cpp's -j takes it: '{\"type\": \"object\"}')")
    gx.add_argument("--grammar", "--grammar-file", dest="grammar", metavar="FILE", default=None,
                    help="constrain the output to the grammar in FILE (GBNF / EBNF as llama.cpp writes it; "
                         "inline text with '::=' is taken as the grammar itself)")
    options.add_options(g, "generate")
    add_sampling_flags(g, 128)
    g.set_defaults(func=run)


def _read_text(path: str, failure: str, stdin: bool = False) -> str:
    """The UTF-8 text of file ``path`` (with ``stdin``, ``-`` is standard input); a user error ``failure: why``
    if it cannot be read."""
    try:
        return sys.stdin.read() if stdin and path == "-" else Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"{failure}: {getattr(e, 'strerror', None) or e}") from None


def _read_prompt(args) -> str:
    if args.prompt is not None and args.file is not None:
        raise CLIError("give the prompt with -p or -f, not both")
    if args.file is None:
        return args.prompt if args.prompt is not None else DEFAULT_PROMPT
    prompt = _read_text(args.file, f"cannot read prompt file {args.file}", stdin=True)
    return prompt[:-1] if args.file != "-" and prompt.endswith("\n") else prompt


def _constraint(args):
    """StructuredOutputsParams from --json-schema / --grammar, checked (as far as it goes without the
    tokenizer) before the model loads."""
    from specdecode.structured import StructuredOutputsParams

    path, kind = (args.json_schema, "json") if args.json_schema else (args.grammar, "grammar")
    if path is None:
        return None
    flag = "--json-schema" if kind == "json" else "--grammar"
    inline = path.lstrip().startswith("{") if kind == "json" else "::=" in path
    if inline and not Path(path).expanduser().is_file():
        text = path
    else:
        text = _read_text(path, f"{flag}: cannot read {path}")
    try:
        return StructuredOutputsParams(**{kind: text})
    except ValueError as e:
        raise CLIError(f"{flag} {path}: {e}") from None


def _read_suffix(args) -> str | None:
    if args.suffix_file is not None:  # the rest of a file, its last newline included
        return _read_text(args.suffix_file, f"cannot read suffix file {args.suffix_file}")
    return args.suffix


def run(args) -> int:
    suffix = _read_suffix(args)
    fim = "--suffix-file" if args.suffix_file is not None else "--suffix" if suffix is not None else None
    if fim and (args.chat or args.system is not None):
        raise CLIError(f"{fim} fills in the middle of plain text, without the chat template: drop "
                       f"{'--chat' if args.chat else '--system'}")
    if fim and args.prompt is None and args.file is None:
        raise CLIError(f"{fim} fills the gap after the prompt: give the text before it with -p or -f")
    args.raw = args.raw or fim is not None
    if args.raw and args.chat:
        raise CLIError("--raw and --chat contradict each other; pass one")
    if args.raw and args.system is not None:
        raise CLIError("--system is a chat message, and --raw turns the chat template off; pass one")
    if args.echo and args.chat:
        raise CLIError("--echo prints a --raw prompt; with --chat the prompt is a conversation")
    prompt = _read_prompt(args)
    if not prompt.strip() and not args.chat and not (suffix or "").strip():
        raise CLIError("the prompt is empty")
    params = sampling_params(args)  # validates before the slow model load
    if args.prediction is not None:
        text = _read_text(args.prediction, f"cannot read prediction file {args.prediction}")
        params = params.clone(prediction=text or None)
    constraint = _constraint(args)
    if constraint is not None:
        params = params.clone(structured_outputs=constraint)
    engine = load_engine(engine_kwargs(args, max_num_seqs=1))
    has_template = bool(getattr(engine.tokenizer, "chat_template", None))
    if args.chat and not has_template:
        raise CLIError(f"--chat: {engine.model_path} has no chat template; drop --chat for plain completion")
    use_chat = has_template and not args.raw
    if args.system is not None and not use_chat:
        raise CLIError(f"--system is a chat message, and {engine.model_path} has no chat template")
    if args.echo and use_chat:
        raise CLIError("--echo prints the prompt of a plain completion: add --raw")
    if use_chat:
        from specdecode.tokenizer import apply_chat_template
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        text = apply_chat_template(engine.tokenizer, msgs + [{"role": "user", "content": prompt}])
    else:
        text = prompt
    try:
        ids = engine.input_processor.encode_prompt(text, suffix=suffix)
    except ValueError as e:
        if fim and str(e).startswith("suffix"):
            raise CLIError(f"{fim}: {e}") from None
        raise
    if params.structured_outputs is not None:
        try:
            engine.grammar_compiler.compile(params.structured_outputs)
        except ValueError as e:
            from specdecode.structured.tools import xgrammar_message
            raise CLIError(f"{'--json-schema' if args.json_schema else '--grammar'}: {xgrammar_message(str(e))}") \
                from None
    if args.json:
        result = stream(engine, "generate", ids, params, None)
    else:
        if args.echo and not use_chat:
            sys.stdout.write(prompt)
        result = stream(engine, "generate", ids, params, sys.stdout)
        if args.echo and suffix is not None:
            sys.stdout.write(suffix)
        sys.stdout.write("\n")
        sys.stdout.flush()
    s = stats(engine, result)
    error = result["output"].error  # the request failed in the engine (logged there); what it produced is shown
    if args.json:
        c = result["output"].outputs[0]
        fields = {"prompt": prompt} | ({"suffix": suffix} if suffix is not None else {})
        print(json.dumps({**fields, "chat_template": use_chat, "text": c.text, "token_ids": list(c.token_ids),
                          "prompt_token_ids": list(result["output"].prompt_token_ids),
                          "finish_reason": c.finish_reason, "error": error, "stats": s}, ensure_ascii=False))
    else:
        print(format_stats(s), file=sys.stderr)
    return 1 if error is not None or result["output"].outputs[0].finish_reason == "error" else 0
