"""Plain greedy decoding: specdecode vs transformers' generate on the same model, dtype and thread count.

    python benchmarks/bench_vs_transformers.py [--model PATH] [--tokens 64] [--threads 2] [--rounds 2]

Both engines run in this process, interleaved (A, B, A, B, ...), so machine drift hits both; prints tokens/s
for each and the ratio. The default model is the embedded default target (GGUF, dequantized to fp32).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quantization", default=None, help="also run specdecode with this weight quantization")
    ap.add_argument("--prompt", default="Write a Python function that returns the n-th Fibonacci number.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from specdecode import LLM, SamplingParams
    from specdecode.models.resolve import resolve_model

    path = resolve_model(args.model, "target")
    ours = {"fp32": LLM(str(path), dtype="float32", max_model_len=1024, num_threads=args.threads)}
    if args.quantization:
        ours[args.quantization] = LLM(str(path), dtype="float32", max_model_len=1024, num_threads=args.threads,
                                      quantization=args.quantization)
    tok = ours["fp32"].get_tokenizer()
    if Path(path).is_file():
        hf = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name,
                                                  dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    hf.eval()
    ids = tok.encode(args.prompt)
    sp = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def run_ours(llm) -> tuple[float, list[int]]:
        t = time.perf_counter()
        out = llm.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=False)[0]
        return time.perf_counter() - t, out.outputs[0].token_ids

    def run_hf() -> tuple[float, list[int]]:
        x = torch.tensor([ids])
        t = time.perf_counter()
        with torch.inference_mode():
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                            do_sample=False, pad_token_id=tok.eos_token_id)
        return time.perf_counter() - t, y[0, len(ids):].tolist()

    run_hf()  # warm-up, excluded
    for llm in ours.values():
        run_ours(llm)
    times: dict[str, list[float]] = {"transformers": [], **{f"specdecode-{k}": [] for k in ours}}
    outs = {}
    for _ in range(args.rounds):
        dt, outs["transformers"] = run_hf()
        times["transformers"].append(dt)
        for k, llm in ours.items():
            dt, outs[f"specdecode-{k}"] = run_ours(llm)
            times[f"specdecode-{k}"].append(dt)
    base = args.tokens / min(times["transformers"])
    print(f"model={path} threads={args.threads} tokens={args.tokens} prompt_tokens={len(ids)} "
          "(end-to-end incl. prefill, best of rounds)")
    for name, ts in times.items():
        tps = args.tokens / min(ts)
        same = outs[name] == outs["transformers"]
        print(f"{name:>22}: {tps:7.2f} tok/s  ratio vs transformers {tps / base:5.2f}x  "
              f"same tokens as transformers: {same}")


if __name__ == "__main__":
    main()
