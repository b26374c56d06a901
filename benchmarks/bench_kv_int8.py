"""The 8-bit KV cache against the 16-bit one: next-token quality and decode speed at a long context.

    python benchmarks/bench_kv_int8.py [--model default] [--ctx 8192] [--gen 64] [--quality-len 4096]

For each cache (``--dtypes``, default ``auto`` = float16 on CPU, and ``int8``) one LLM (one slot, greedy):

* speed: a prompt of --ctx tokens of a local Python stdlib source file; a first request of one token
  prefills it (its time is reported as prefill s) and leaves it in the prefix cache, then --gen tokens are
  generated with speculation off, and (for the dtypes in --spec-dtypes) once more with the default
  speculation; decode tok/s = (tokens - 1) / (finish - first token) of each request;
* quality: the same model in a fresh runner over --quality-len tokens of the text; at --windows evenly spread
  depths it keeps the next-token distributions of --rows consecutive positions. Against the first dtype's
  (the reference) it reports top-1 agreement and mean KL(reference || this) in nats.

Prints one JSON object. Greedy outputs of the plain runs are compared too (same_output_as_ref).
"""
from __future__ import annotations

import argparse
import inspect
import json
import time
from types import SimpleNamespace

import torch


def _text_ids(tok, n: int, source: str) -> list[int]:
    """At least n token ids of local Python source (the named stdlib module's file, then more if short)."""
    import importlib

    mods = [source, "argparse", "typing", "inspect", "dataclasses", "functools", "pathlib"]
    ids: list[int] = []
    for name in dict.fromkeys(mods):
        ids += tok.encode(inspect.getsource(importlib.import_module(name)), add_special_tokens=False)
        if len(ids) >= n:
            break
    if len(ids) < n:
        raise SystemExit(f"not enough local source text for {n} tokens")
    return ids[:n]


def _speed(llm, ids: list[int], gen: int, spec: bool) -> dict:
    from specdecode import SamplingParams

    p = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True, speculative_decoding=spec)
    t0 = time.perf_counter()
    out = llm.generate(prompt_token_ids=[ids], sampling_params=p, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    res = {"tokens": n, "cached_prompt_tokens": m.num_cached_tokens, "wall_s": round(wall, 2),
           "decode_tok_s": round((n - 1) / (m.finished_time - m.first_token_time), 2)}
    if spec:
        s = m.spec_decode
        res.update(drafted=s.num_draft_tokens, accepted=s.num_accepted_tokens)
    return res, list(out.outputs[0].token_ids)


def _distributions(llm, dtype: str, ids: list[int], windows: int, rows: int) -> torch.Tensor:
    """log-softmax [windows * rows, V] of the next-token logits at `windows` depths of ids, a fresh runner on
    the LLM's target model with a cache of `dtype` (the LLM is not usable afterwards: the model's layers are
    bound to the new cache)."""
    from specdecode.engine.model_runner import ModelRunner

    t = llm.llm_engine.target
    runner = ModelRunner(SimpleNamespace(model=t.model, hf_config=t.hf_config), 1, len(ids) + 16, "cpu",
                         kv_cache_dtype=dtype)
    n = len(ids)
    starts = [int((i + 1) * (n - rows) / windows) for i in range(windows)]
    out, cur = [], 0
    for s in starts:
        if s > cur:
            runner.prefill(0, ids[cur:s], start=cur)
        logits = runner.prefill_many([(0, s, ids[s:s + rows])], all_logits=[True])[0]
        out.append(torch.log_softmax(logits.float(), -1))
        cur = s + rows
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "int8"], help="the first is the reference")
    ap.add_argument("--spec-dtypes", nargs="*", default=["int8"], help="dtypes also timed with speculation")
    ap.add_argument("--ctx", type=int, default=8192, help="prompt tokens of the speed runs (0: no speed runs)")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--quality-len", type=int, default=4096, help="tokens of text for quality (0: none)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--source", default="argparse", help="stdlib module whose source is the text")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdecode import LLM

    res: dict = {"model": args.model, "ctx": args.ctx, "gen": args.gen, "quality_len": args.quality_len,
                 "threads": torch.get_num_threads(), "runs": {}}
    ref_lp = ref_out = None
    for dtype in args.dtypes:
        r: dict = {}
        t0 = time.perf_counter()
        llm = LLM(model=args.model, kv_cache_dtype=dtype, max_num_seqs=1, seed=0,
                  max_model_len=max(args.ctx, args.quality_len) + args.gen + 64)
        r["load_s"] = round(time.perf_counter() - t0, 1)
        kv = llm.llm_engine.target.kv_cache
        r["target_kv_bytes_per_token"] = kv.bytes_per_token
        tok = llm.get_tokenizer()
        if args.ctx:
            ids = _text_ids(tok, args.ctx, args.source)
            from specdecode import SamplingParams
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=[ids], use_tqdm=False,
                         sampling_params=SamplingParams(max_tokens=1, temperature=0.0, speculative_decoding=False))
            r["prefill_s"] = round(time.perf_counter() - t0, 1)
            r["plain"], out = _speed(llm, ids, args.gen, spec=False)
            if ref_out is None:
                ref_out = out
            r["plain"]["same_output_as_ref"] = out == ref_out
            if dtype in args.spec_dtypes:
                r["speculative"], spec_out = _speed(llm, ids, args.gen, spec=True)
                r["speculative"]["same_output_as_plain"] = spec_out == out
        if args.quality_len:
            lp = _distributions(llm, dtype, _text_ids(tok, args.quality_len, args.source), args.windows, args.rows)
            if ref_lp is None:
                ref_lp = lp
            else:
                kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
                r["quality_vs_ref"] = {"positions": lp.shape[0],
                                       "top1_agreement": round((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean().item(), 4),
                                       "mean_kl_nats": float(f"{kl.mean().item():.3g}"),
                                       "max_kl_nats": float(f"{kl.max().item():.3g}")}
        res["runs"][dtype] = r
        print(json.dumps({dtype: r}), flush=True)
        del llm
    print(json.dumps(res))


if __name__ == "__main__":
    main()
