"""``specdecode serve``: the OpenAI-compatible server (vLLM's ``vllm serve``), or Ray Serve replicas of it."""
from __future__ import annotations

import os
import sys

from specdecode.entrypoints.cli._shared import OPT_OUTS, CLIError, Formatter


def add_parser(sub) -> None:
    from specdecode.entrypoints.openai.cli_args import add_server_args

    s = sub.add_parser("serve", formatter_class=Formatter, help="OpenAI-compatible HTTP server",
                       description="Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) "
                                   f"with speculative decoding. {OPT_OUTS}.",
                       epilog="examples:\n  specdecode serve --port 8000\n"
                              "  specdecode serve model.gguf --speculative-model draft.gguf --port 8000\n"
                              "  specdecode serve --ray --num-replicas 2")
    s.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="target model: a .gguf file or an HF directory (default: the built-in pair)")
    s.add_argument("--model", "-m", "--model-path", dest="engine.model", default=None, metavar="TARGET",
                   help="the same as MODEL (vLLM's spelling)")
    add_server_args(s)
    s.set_defaults(func=run)


def run(args) -> int:
    flag_model = getattr(args, "engine.model", None)
    if args.model_tag and flag_model and args.model_tag != flag_model:
        raise CLIError(f"two different models given: {args.model_tag} and --model {flag_model}")
    model = args.model_tag or flag_model
    ray_only = [f for f, v in (("--num-replicas", args.num_replicas), ("--ray-address", args.ray_address),
                               ("--num-cpus-per-replica", args.num_cpus_per_replica),
                               ("--request-router", args.request_router)) if v is not None]
    if ray_only and not args.ray:
        raise CLIError(f"{ray_only[0]} applies to a Ray Serve deployment: add --ray")
    if args.ray:
        from specdecode import startup
        from specdecode.entrypoints.openai.cli_args import engine_kwargs_from_args

        startup.resume()  # the engines load in Ray's replica processes; this one only drives them
        try:
            from specdecode.entrypoints.ray.serve import serve_from_args
        except ImportError as e:
            raise CLIError(f"--ray needs Ray Serve ({e}): pip install 'specdecode[ray]'") from None
        try:
            return serve_from_args(args, engine_kwargs_from_args(args, model)) or 0
        except ImportError as e:
            if (e.name or "").split(".")[0] != "ray":
                raise
            raise CLIError(f"--ray needs Ray Serve ({e}): pip install 'specdecode[ray]'") from None
    from specdecode.engine.async_engine import AsyncLLMEngine
    from specdecode.entrypoints.openai.cli_args import engine_kwargs_from_args

    # The models load on the engine thread while this one imports the web stack: the load spends much of its
    # time outside the GIL (reading and checksumming the packed weights), so the two overlap.
    try:
        engine = AsyncLLMEngine.from_kwargs(wait=False, **engine_kwargs_from_args(args, model))
    except ValueError:
        engine = None  # run_server reports the bad setting in its one-line form
    from specdecode.entrypoints.openai.api_server import run_server

    run_server(args, model, engine)
    # Served and shut down: the engine thread has stopped and every response has been sent. Tearing down the
    # interpreter (torch, the model's tensors, OpenMP's threads) would add more than a second after the
    # graceful-shutdown period the user asked for, and has nothing left to save.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
