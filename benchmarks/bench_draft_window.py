"""Acceptance and draft cost against the draft's window (draft_window), at long prompts, with the default pair.

Each prompt (local source files and a question about them, bench.datasets.long_context_dataset) is answered
greedily with the draft model alone at a fixed k (no lookups, no adaptive k: acceptance is the draft's own),
once per window; acceptance is deterministic, times are wall-clock on a shared machine.

    python benchmarks/bench_draft_window.py --lengths 2k,8k --windows 0,256,512,1024,2048 --max-tokens 128
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

from specdecode.bench.datasets import long_context_dataset, parse_length
from specdecode.engine.llm_engine import LLMEngine
from specdecode.sampling_params import SamplingParams
from specdecode.tokenizer import apply_chat_template


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2k,8k")
    ap.add_argument("--windows", default="0,256,512,1024,2048")
    ap.add_argument("--per-length", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--draft-quantization", default=None, help="the draft's weight format (default: the preset's)")
    args = ap.parse_args()
    lengths = [parse_length(x) for x in args.lengths.split(",")]
    windows = [int(x) for x in args.windows.split(",")]
    eng = LLMEngine.from_kwargs(max_num_seqs=1, num_speculative_tokens=args.k, speculative_adaptive=False,
                                speculative_ngram_first=False, max_model_len=max(lengths) + args.max_tokens + 64,
                                speculative_model_quantization=args.draft_quantization)
    tok = eng.tokenizer

    def encode(text: str) -> list[int]:
        return eng.input_processor.encode_prompt(apply_chat_template(tok, [{"role": "user", "content": text}]))

    ds = long_context_dataset(lengths, lambda t: len(tok.encode(t)), args.per_length)
    base = eng.config.speculative
    rows = []
    for p in ds.prompts:
        ids = encode(p.text)
        ref = None
        for j, w in enumerate(windows):
            eng.set_speculative(dataclasses.replace(base, draft_window=w))
            if j == 0:
                # Later windows take the target's prompt from the prefix cache (its prefill is the same for
                # every window and the slowest part at 8k+). A windowed draft never reads the draft's cached
                # keys (it rebuilds its view), so its prefill is still timed; a window that covers the whole
                # prompt reuses them: run window 0 first to time the whole-context draft.
                eng.reset_prefix_cache()
            proposer = eng.proposer
            pre0 = proposer.prefill_seconds
            t0 = time.perf_counter()
            eng.add_request(f"{p.id}-{w}", None, prompt_token_ids=ids,
                            params=SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
            t_first = None
            final = None
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if t_first is None and out.outputs[0].token_ids:
                        t_first = time.perf_counter()
                    if out.finished:
                        final = out
            t_end = time.perf_counter()
            spec = final.metrics.spec_decode
            tokens = list(final.outputs[0].token_ids)
            ref = tokens if ref is None else ref
            row = dict(prompt=p.id, length=p.category, prompt_tokens=len(ids), window=w,
                       drafted=spec.num_draft_tokens, accepted=spec.num_accepted_tokens,
                       acceptance=spec.num_accepted_tokens / max(1, spec.num_draft_tokens),
                       draft_prefill_s=proposer.prefill_seconds - pre0, ttft_s=t_first - t0,
                       decode_s=t_end - t_first, e2e_s=t_end - t0, same_output=tokens == ref)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
