"""How close the quantized CPU formats stay to the unquantized model.

    python benchmarks/quant_quality.py [--model PATH] [--prompts 8] [--max-len 256] [--quantizations int8,w8a8,w4a8]

Teacher-forces the chat-formatted first turn of one Spec-Bench prompt per category through the model at
its default dtype and with each quantization, and reports, over all positions, how often the top-1 next token
agrees with the unquantized model's and the mean KL(unquantized || quantized) of the next-token distribution.
The models run one after the other, so only one is in memory at a time.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode.bench.datasets import load_dataset
from specdecode.layers.attention import ForwardBatch
from specdecode.models.default_models import default_model_path
from specdecode.models.loader import load_model
from specdecode.engine.model_runner import ModelRunner
from specdecode.tokenizer import apply_chat_template, load_tokenizer


def _logprobs(path: Path, quantization: str | None, seqs: list[list[int]], max_len: int) -> list[torch.Tensor]:
    loaded = load_model(path, "auto", "cpu", max_len, quantization)
    runner = ModelRunner(loaded, 1, max_len, "cpu")  # binds the KV cache
    out = []
    for ids in seqs:
        n = len(ids)
        t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        pos = list(range(n))
        runner.kv_cache.ensure(0, n)  # the slot's blocks for these positions
        b = ForwardBatch(t(ids), t(pos), t([0] * n), [0] * n, pos, prefill=True, logits_rows=t(pos))
        out.append(runner.model(b).float().log_softmax(-1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target model (default: the built-in default target)")
    ap.add_argument("--dataset", default=str(Path(__file__).resolve().parents[2] / "shared/bench/spec_bench_questions.jsonl"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=256, help="tokens per prompt (longer prompts are cut)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantizations", default="int8,w8a8,w4a8", help="comma-separated formats to compare")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_model_path("target")
    tok = load_tokenizer(path, path.is_file())
    seqs = [tok.encode(apply_chat_template(tok, [{"role": "user", "content": p.text}]))[:args.max_len]
            for p in load_dataset(args.dataset, 1).prompts[:args.prompts]]  # the first prompt of each category
    ref = _logprobs(path, None, seqs, args.max_len)
    total = sum(len(s) for s in seqs)
    print(f"model={path} positions={total}")
    for q in args.quantizations.split(","):
        agree, kl = 0, 0.0
        for r, lp in zip(ref, _logprobs(path, q, seqs, args.max_len)):
            agree += int((lp.argmax(-1) == r.argmax(-1)).sum())
            kl += float(F.kl_div(lp, r, log_target=True, reduction="sum"))
        print(f"{q:>5}: top-1 agreement {agree / total:.4f}   mean KL {kl / total:.5f}")


if __name__ == "__main__":
    main()
