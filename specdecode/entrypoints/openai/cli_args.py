"""The server's command-line flags (vLLM's names), shared by ``specdecode serve`` and
``python -m specdecode.entrypoints.openai.api_server``. Engine and speculative flags come from the option table
(specdecode/options.py), so the server takes every option ``generate`` takes, under the same names."""
from __future__ import annotations

import argparse
import errno
from typing import Any

from specdecode import options
from specdecode.models.context import check_max_model_len
from specdecode.parsers import float_in, int_at_least


DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_LIMIT_CONCURRENCY = 1024  # requests in progress; beyond it a 503 with Retry-After (not /health)


# --port is checked while the flags are parsed, before the models start loading (exiting while a native loader
# thread runs aborts the process instead of exiting with code 2).
port_number = int_at_least(0, 65535)


# Checked while the flags are parsed, so a server never starts with limits that refuse every request.
_POSITIVE_INT, _POSITIVE_SECONDS, _SECONDS = int_at_least(1), float_in(0.0, lo_open=True), float_in(0.0)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server's flags (the model itself is added by the caller)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", metavar="HOST",
                   help="Interface to bind (default 127.0.0.1; 0.0.0.0 for all).")
    g.add_argument("--port", type=port_number, default=8000, metavar="PORT", help="Port to listen on (default 8000).")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="Require 'Authorization: Bearer KEY' on /v1/* (default: $SPECDECODE_API_KEY, or none).")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="Model name(s) clients use in the 'model' field (default: the model argument).")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--timeout-graceful-shutdown", type=_SECONDS, default=30.0, metavar="SECONDS",
                   help="Seconds in-flight requests get to finish after SIGINT/SIGTERM (default 30); streams "
                        "still running then end with an error event.")
    g.add_argument("--max-request-body-bytes", type=_POSITIVE_INT, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help=f"Larger request bodies get HTTP 413 before they are parsed (default {DEFAULT_MAX_BODY_BYTES}).")
    g.add_argument("--request-body-timeout", type=_POSITIVE_SECONDS, default=DEFAULT_BODY_TIMEOUT, metavar="SECONDS",
                   help="A request body not whole this long after its headers gets HTTP 408 (default 30).")
    g.add_argument("--limit-concurrency", type=_POSITIVE_INT, default=DEFAULT_LIMIT_CONCURRENCY, metavar="N",
                   help=f"Requests in progress beyond this get HTTP 503 with Retry-After; /health and /metrics are "
                        f"always answered (default {DEFAULT_LIMIT_CONCURRENCY}).")
    g.add_argument("--metrics-require-key", action="store_true",
                   help="Put /metrics behind --api-key too (default: open, as in vLLM; /health is always open).")
    r = parser.add_argument_group("ray serve")
    r.add_argument("--ray", action="store_true",
                   help="Serve through Ray Serve, with --num-replicas engine replicas (pip install 'specdecode[ray]').")
    r.add_argument("--num-replicas", type=_POSITIVE_INT, default=None, metavar="N",
                   help="Engine replicas under Ray Serve (with --ray; default 1).")
    r.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="Join this Ray cluster (default: $RAY_ADDRESS, else a local one).")
    r.add_argument("--num-cpus-per-replica", type=_POSITIVE_INT, default=None, metavar="N",
                   help="CPUs Ray reserves per replica, also its engine's thread count unless --threads is given.")
    r.add_argument("--request-router", choices=("prefix", "pow2"), default=None,
                   help="How Ray Serve picks a replica: prefix (default: the replica that holds the longest shared "
                        "prompt prefix, unless the load is imbalanced) or pow2 (Ray's power of two choices).")
    groups: dict[str, Any] = {"server": g}  # the table's serve-only options join the server flags
    options.add_options(parser, "serve", skip=("model",), groups=groups)


def engine_kwargs_from_args(args: argparse.Namespace, model: str | None) -> dict[str, Any]:
    """Engine keyword arguments from parsed flags (ValueError for a malformed --speculative-config); options not
    given are left to the preset (EngineConfig.from_kwargs)."""
    kw: dict[str, Any] = options.kwargs_from_args(args)
    kw["model"] = model
    check_max_model_len(kw)
    return kw


def is_out_of_memory(e: BaseException) -> bool:
    """A failed allocation while the engine loads: mmap's ENOMEM or torch's CPU allocator."""
    return (isinstance(e, OSError) and e.errno == errno.ENOMEM) or \
        (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def out_of_memory_message(kw: dict[str, Any]) -> str:
    """The one-line error for a KV cache (max_num_seqs slots x max_model_len positions) that does not fit."""
    n, seqs = kw.get("max_model_len"), kw.get("max_num_seqs")
    size = " x ".join(x for x in (f"--max-num-seqs {seqs}" if seqs else "",
                                  f"--max-model-len {n}" if n else "") if x)
    return (f"the KV cache{f' for {size}' if size else ''} does not fit in memory (the allocation failed); lower "
            "--max-model-len or --max-num-seqs.")
