"""What verifying drafts costs on a mixture of experts, beside a dense model of the same active size.

Speculation pays when a pass over k + 1 rows costs little more than a pass over one: on a CPU a decode pass is
bound by reading the weights, and a dense model reads them once whatever the row count. A mixture of experts
reads only the experts its rows are routed to, so a pass over 5 tokens can read up to 5 times as many expert
weights as a pass over one. This times both models' passes over 1..5 rows with the adaptive policy's own
calibration (speculative/adaptive/calibration.py), and says which k the policy (planner.choose_k) picks for
n-gram drafts at a range of acceptance rates.

Both models are random (the cost does not depend on the values, only the MoE's routing spreads tokens over
experts as a trained router does), with float weights packed into ``--quantization`` (w8a8 is what "auto"
gives a large float checkpoint).

    python -m specdecode.bench.moe_cost [--hidden 1024 --experts 8 --active 2 --layers 4 --quantization w8a8]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdecode.engine.model_runner import ModelRunner
from specdecode.layers.linear import Linear
from specdecode.layers.moe import MoEArgs
from specdecode.models.loader import LoadedModel
from specdecode.models.model import CausalLM, ModelArgs
from specdecode.speculative.adaptive.calibration import calibrate
from specdecode.speculative.adaptive.costs import CostModel
from specdecode.speculative.adaptive.planner import choose_k

MAX_LEN = 1024
K_MAX = 4


def random_model(args: ModelArgs, quantization: str | None, seed: int = 0) -> LoadedModel:
    """A model of ``args`` with random weights, packed layer by layer (one layer at full precision at a time)."""
    torch.manual_seed(seed)
    model = CausalLM(args, MAX_LEN).eval()

    def fill(module: torch.nn.Module, std: float) -> None:
        for name, p in module.named_parameters(recurse=False):
            if name == "weight" and p.dim() == 1:
                p.data.fill_(1.0)  # norms
            else:
                p.data.normal_(0.0, std)

    for part in [model.embed_tokens, model.norm, model.lm_head, *model.layers]:
        for m in part.modules():
            fill(m, 0.02 if not isinstance(m, Linear) else m.in_features ** -0.5)
        if part in model.layers:
            part.fuse_projections()
        for m in part.modules():
            if isinstance(m, Linear):
                m.prepare(quantization)
    return LoadedModel(model, {}, Path("random"), False, MAX_LEN)


def measure(args: ModelArgs, quantization: str | None, repeats: int) -> CostModel:
    runner = ModelRunner(random_model(args, quantization), 1, MAX_LEN, "cpu")
    return calibrate(runner, None, K_MAX, MAX_LEN, repeats=repeats, contexts=(32, 512))


def policy(costs: CostModel, context: int) -> dict[str, int]:
    """choose_k for n-gram drafts (no draft model cost) at acceptance rates p1 = q = p."""
    return {f"{p:.1f}": choose_k(p, p, K_MAX, costs, True, context) for p in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--active", type=int, default=2)
    ap.add_argument("--expert-intermediate", type=int, default=3584, help="per expert (Mixtral's 3.5 x hidden)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--quantization", default="w8a8", help="weight format of the linears; 'none' for float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the results here")
    o = ap.parse_args(argv)
    quant = None if o.quantization == "none" else o.quantization
    heads = o.hidden // 64
    base = dict(vocab_size=o.vocab, hidden_size=o.hidden, num_layers=o.layers, num_heads=heads,
                num_kv_heads=max(1, heads // 4), head_dim=64, max_position_embeddings=MAX_LEN)
    moe = ModelArgs(family="moe", intermediate_size=o.expert_intermediate,
                    moe=MoEArgs(o.experts, o.active, o.expert_intermediate, norm_topk_prob=True), **base)
    # the same active parameters per token: one MLP as wide as the active experts together
    dense = ModelArgs(family="dense", intermediate_size=o.active * o.expert_intermediate, **base)
    out = {"threads": torch.get_num_threads(), "quantization": quant, "shape": vars(o) | {"json": None}}
    for name, args in (("dense", dense), ("moe", moe)):
        t0 = time.perf_counter()
        costs = measure(args, quant, o.repeats)
        res = {"calibration_s": round(time.perf_counter() - t0, 1), "other_cpu_share": costs.other_cpu_share}
        for ctx, table in sorted(costs.verify.items()):
            res[f"ctx{ctx}"] = {"ms": {r: round(1e3 * s, 2) for r, s in sorted(table.items())},
                                "ratio_5_to_1": round(table[5] / table[1], 2), "choose_k": policy(costs, ctx)}
        out[name] = res
        print(name, json.dumps(res))
    if o.json:
        o.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
