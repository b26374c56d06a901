"""Prefill speed at long prompts: ours against llama.cpp's llama-bench on the same GGUF file, alternated per length.

    python benchmarks/bench_prefill.py --llama-bench $(bash ../shared/peers/build_llama_cpp.sh)/llama-bench \
        [--lengths 2048 8192 32512] [--model default] [--gguf PATH] [--fa auto]

Ours: one LLM of the target alone (speculation off, prefix caching off, one slot), a prompt of N tokens of local
Python source, one generated token; prefill tok/s = N / time to first token, the engine's chunking as a user
gets it (``--max-num-batched-tokens``). llama.cpp: ``llama-bench -p N -n 0 -r 1`` (random tokens; content does
not change the cost) with the same thread count. The two run in turn for each length, the order swapped each
length, so that a slow minute of a noisy machine falls on both. Prints one JSON object with a row per length
and the ratio ours / llama.cpp.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

from bench_kv_int8 import _text_ids


def _ours(llm, ids: list[int]) -> float:
    from specdecode import SamplingParams

    p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompt_token_ids=[ids], sampling_params=p, use_tqdm=False)
    return len(ids) / (time.perf_counter() - t0)


def _llama(bench: str, gguf: str, n: int, threads: int, fa: str) -> float:
    cmd = [bench, "-m", gguf, "-p", str(n), "-n", "0", "-r", "1", "-t", str(threads), "-fa", fa, "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32512])
    ap.add_argument("--model", default="default", help="our target (default: the default pair's target)")
    ap.add_argument("--gguf", default=None, help="llama.cpp's file (default: the default target's GGUF)")
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary (none: ours only)")
    ap.add_argument("--fa", default="auto", help="llama-bench's --flash-attn")
    ap.add_argument("--batched-tokens", type=int, default=None, help="our --max-num-batched-tokens")
    args = ap.parse_args()
    from specdecode import LLM
    from specdecode.models.default_models import default_model_path

    gguf = args.gguf or str(default_model_path("target"))
    extra = {"max_num_batched_tokens": args.batched_tokens} if args.batched_tokens else {}
    llm = LLM(model=args.model, speculative_config={"method": "none"}, enable_prefix_caching=False,
              max_num_seqs=1, max_model_len=max(args.lengths) + 1, seed=0, **extra)
    tok = llm.get_tokenizer()
    ids = _text_ids(tok, max(args.lengths), "argparse")
    _ours(llm, ids[:64])  # warm-up: first-call costs out of the timed runs
    threads = torch.get_num_threads()
    rows = []
    for i, n in enumerate(args.lengths):
        row: dict = {"tokens": n}
        order = ["ours", "llama.cpp"] if i % 2 == 0 else ["llama.cpp", "ours"]
        for who in order:
            if who == "ours":
                row["ours_tok_s"] = round(_ours(llm, ids[:n]), 1)
            elif args.llama_bench:
                row["llama_cpp_tok_s"] = round(_llama(args.llama_bench, gguf, n, threads, args.fa), 1)
        if "llama_cpp_tok_s" in row:
            row["ratio"] = round(row["ours_tok_s"] / row["llama_cpp_tok_s"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"model": args.model, "gguf": gguf, "threads": threads, "fa": args.fa, "rows": rows}))


if __name__ == "__main__":
    main()
