"""The 8-bit KV cache against the 16-bit one: next-token quality and decode speed at a long context.

    python benchmarks/bench_kv_int8.py [--model default] [--ctx 8192] [--gen 64] [--quality-len 4096]

For each cache (``--dtypes``, default ``auto`` = float16 on CPU, and ``int8``) one LLM (one slot, greedy):

* speed: a prompt of --ctx tokens of a local Python stdlib source file; a first request of one token
  prefills it (its time is reported as prefill s) and leaves it in the prefix cache, then --gen tokens are
  generated in an engine without speculation, and (for the dtypes in --spec-dtypes) in another with the
  default speculation; decode tok/s = (tokens - 1) / (finish - first token) of each request;
* quality: one more load of the target, one runner (cache) per dtype over --quality-len tokens of the text;
  at --windows evenly spread depths it keeps the next-token distributions of --rows consecutive positions.
  Against the first dtype's (the reference) it reports top-1 agreement and mean KL(reference || this) in
  nats. Then it times --steps single-row decode steps of the bare model at that context, the dtypes
  interleaved (decode_step_ms_at_<quality-len>): the cache's own effect on a step, without the engine.

Prints one JSON object. Greedy outputs of the plain runs are compared too (same_output_as_ref).
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
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


def _runner(model, hf_config, dtype: str, max_len: int):
    from specdecode.engine.model_runner import ModelRunner

    return ModelRunner(SimpleNamespace(model=model, hf_config=hf_config), 1, max_len, "cpu", kv_cache_dtype=dtype)


def _bind(runner) -> None:
    """Point the model's attention layers at this runner's cache (several runners share one model here)."""
    from specdecode.layers.attention import Attention

    for i, m in enumerate(m for m in runner.model.modules() if isinstance(m, Attention)):
        m.bind_kv_cache(runner.kv_cache, i)


def _distributions(runner, ids: list[int], windows: int, rows: int) -> torch.Tensor:
    """log-softmax [windows * rows, V] of the next-token logits at `windows` evenly spread depths of ids; the
    runner's cache then holds all of ids."""
    _bind(runner)
    n = len(ids)
    starts = [int((i + 1) * (n - rows) / windows) for i in range(windows)]
    out, cur = [], 0
    for s in starts:
        if s > cur:
            runner.prefill(0, ids[cur:s], start=cur)
        logits = runner.prefill_many([(0, s, ids[s:s + rows])], all_logits=[True])[0]
        out.append(torch.log_softmax(logits.float(), -1))
        cur = s + rows
    if cur < n:
        runner.prefill(0, ids[cur:n], start=cur)
    return torch.cat(out)


def _step_times(runners: dict, n: int, steps: int) -> dict:
    """Median ms of a single-row decode step at position n (the model step alone, no engine around it), the
    runners' steps interleaved so that load from other processes hits every cache alike. Each step rewrites
    the same position, as a rolled-back draft would."""
    times: dict = {d: [] for d in runners}
    for i in range(steps + 1):  # the first round is a warm-up
        for d, r in runners.items():
            _bind(r)
            r.model._layer_stack()  # rebuilt for the newly bound cache here, outside the timed step
            t0 = time.perf_counter()
            r.forward_rows([(0, n, [13])], all_logits=False)
            if i:
                times[d].append(time.perf_counter() - t0)
    return {d: round(1e3 * statistics.median(t), 1) for d, t in times.items()}


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
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed after the quality text")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from specdecode import LLM, SamplingParams

    res: dict = {"model": args.model, "ctx": args.ctx, "gen": args.gen, "quality_len": args.quality_len,
                 "threads": torch.get_num_threads(), "runs": {}}
    ref_out = None
    for dtype in args.dtypes if args.ctx else []:
        r: dict = {}
        # Plain decoding in an engine without a draft model, speculation in one with the default speculation:
        # each its own load and prefill of the prompt (the first request, of one token, leaves it in the
        # prefix cache, so the timed request decodes at the full context at once).
        for kind in ["plain"] + (["speculative"] if dtype in args.spec_dtypes else []):
            t0 = time.perf_counter()
            extra = {"speculative_config": {"method": "none"}} if kind == "plain" else {}
            llm = LLM(model=args.model, kv_cache_dtype=dtype, max_num_seqs=1, seed=0,
                      max_model_len=args.ctx + args.gen + 64, **extra)
            r[f"{kind}_load_s"] = round(time.perf_counter() - t0, 1)
            r["target_kv_bytes_per_token"] = llm.llm_engine.target.kv_cache.bytes_per_token
            ids = _text_ids(llm.get_tokenizer(), args.ctx, args.source)
            t0 = time.perf_counter()
            llm.generate(prompt_token_ids=[ids], use_tqdm=False,
                         sampling_params=SamplingParams(max_tokens=1, temperature=0.0, speculative_decoding=False))
            r[f"{kind}_prefill_s"] = round(time.perf_counter() - t0, 1)
            r[kind], out = _speed(llm, ids, args.gen, spec=kind == "speculative")
            if kind == "plain":
                plain_out = out
                if ref_out is None:
                    ref_out = out
                r[kind]["same_output_as_ref"] = out == ref_out
            else:
                r[kind]["same_output_as_plain"] = out == plain_out
            del llm
        res["runs"][dtype] = r
        print(json.dumps({dtype: r}), flush=True)
    if args.quality_len:
        # One model, one runner (cache) per dtype: the same weights and text for every cache.
        llm = LLM(model=args.model, max_num_seqs=1, seed=0, max_model_len=args.quality_len + 64,
                  speculative_config={"method": "none"})
        t = llm.llm_engine.target
        ids = _text_ids(llm.get_tokenizer(), args.quality_len, args.source)
        runners = {d: _runner(t.model, t.hf_config, d, args.quality_len + 16) for d in args.dtypes}
        lps = {}
        for d, runner in runners.items():
            t0 = time.perf_counter()
            lps[d] = _distributions(runner, ids, args.windows, args.rows)
            res["runs"].setdefault(d, {})["quality_prefill_s"] = round(time.perf_counter() - t0, 1)
        ref_lp = lps[args.dtypes[0]]
        for d in args.dtypes[1:]:
            lp = lps[d]
            kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1)
            res["runs"][d]["quality_vs_ref"] = {
                "positions": lp.shape[0], "text_tokens": args.quality_len,
                "top1_agreement": round((lp.argmax(-1) == ref_lp.argmax(-1)).float().mean().item(), 4),
                "mean_kl_nats": float(f"{kl.mean().item():.3g}"), "median_kl_nats": float(f"{kl.median().item():.3g}"),
                "max_kl_nats": float(f"{kl.max().item():.3g}")}
        if args.steps:
            for d, ms in _step_times(runners, args.quality_len, args.steps).items():
                res["runs"][d][f"decode_step_ms_at_{args.quality_len}"] = ms
    print(json.dumps(res))


if __name__ == "__main__":
    main()
