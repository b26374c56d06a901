"""The default LLM() against plain decoding, in one process, on a few chat prompts.

    python benchmarks/bench_default.py [--max-tokens 96] [--rounds 2] [--threads N]

Loads the default engine (the fast preset on the built-in pair) and a second engine of the same target with
w8a8 weights, and runs, interleaved per round: the default; the default's own weights with speculation off
(``set_speculative(None)``); and plain w8a8. Reports each config's best round in tokens/s (all generated
tokens over the wall time of the three prompts, prefill included) and its ratio to both plain configs, and
whether every greedy output is the same token for token.
"""
from __future__ import annotations

import argparse
import time

from specdecode import LLM, SamplingParams
from specdecode.tokenizer import apply_chat_template

PROMPTS = ["Write a Python function that checks whether a string is a palindrome, with tests.",
           "Explain the difference between a process and a thread in three paragraphs.",
           "List the planets of the solar system with one fact each."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    kw = {"max_num_seqs": 1} | ({"num_threads": args.threads} if args.threads else {})
    default = LLM(**kw)
    w8a8 = LLM(quantization="w8a8", speculative_config={"method": "none"}, **kw)
    tok = default.get_tokenizer()
    prompts = [apply_chat_template(tok, [{"role": "user", "content": p}], True) for p in PROMPTS]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    spec = default.engine.config.speculative
    configs = {"default": (default, spec), "plain (default weights)": (default, None), "plain w8a8": (w8a8, None)}
    rates: dict[str, list[float]] = {k: [] for k in configs}
    outputs: dict[str, list] = {}
    for _ in range(args.rounds):
        for name, (llm, sc) in configs.items():
            if llm is default:
                default.engine.set_speculative(sc)
            t0 = time.perf_counter()
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            outputs.setdefault(name, [o.outputs[0].token_ids for o in outs])
            rates[name].append(n / dt)
            print(f"{name:>24}: {n / dt:6.2f} tok/s", flush=True)
    best = {k: max(v) for k, v in rates.items()}
    for k, v in best.items():
        print(f"{k:>24}: best {v:6.2f} tok/s  {v / best['plain (default weights)']:.2f}x plain (default weights)  "
              f"{v / best['plain w8a8']:.2f}x plain w8a8")
    same_spec = outputs["default"] == outputs["plain (default weights)"]
    print(f"default == plain with its weights, token for token: {same_spec}")
    print(f"default == plain w8a8 (another weight format): {outputs['default'] == outputs['plain w8a8']}")


if __name__ == "__main__":
    main()
