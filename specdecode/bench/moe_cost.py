"""What verifying drafts costs on a mixture of experts, beside a dense model of the same active size.

Speculation pays when a pass over k + 1 rows costs little more than a pass over one: on a CPU a decode pass is
bound by reading the weights, and a dense model reads them once whatever the row count. A mixture of experts
reads only the experts its rows are routed to, so a pass over 5 tokens can read up to 5 times as many expert
weights as a pass over one. This times both models' passes over 1..5 rows, interleaved, and gives each model's
timings to the adaptive policy's cost model to say which k it picks (planner.choose_k) for n-gram drafts at a
range of acceptance rates.

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
from typing import Callable

import torch

from specdecode.cpu_share import cpu_times, other_cpu_share
from specdecode.engine.model_runner import ModelRunner
from specdecode.layers.linear import Linear
from specdecode.layers.moe import MoEArgs
from specdecode.models.loader import LoadedModel
from specdecode.models.model import CausalLM, ModelArgs
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


def time_passes(runners: dict[str, ModelRunner], rows: list[int], context: int, rounds: int,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, dict[int, float]]:
    """Seconds of a verification pass over each row count after ``context`` tokens, per model: the fastest of
    ``rounds`` rounds, each timing every model and row count back to back (in a rotating order), so that the
    machine's drift and other processes' load hit both models alike; interference only ever slows a pass.
    ``clock``: wall time, or on one thread the thread's CPU time (time.thread_time), which a machine shared
    with busy processes leaves far steadier: time spent descheduled does not count."""
    ids = torch.randint(0, min(r.vocab_size for r in runners.values()), (context + max(rows),),
                        generator=torch.Generator().manual_seed(0)).tolist()
    best = {name: dict.fromkeys(rows, float("inf")) for name in runners}
    cells = [(name, n) for name in runners for n in rows]
    with torch.inference_mode():
        for r in runners.values():
            r.prefill(0, ids[:context])
        for rnd in range(rounds + 1):  # round 0 warms up
            for name, n in cells[rnd % len(cells):] + cells[:rnd % len(cells)]:
                t0 = clock()
                out = runners[name].forward_rows([(0, context, ids[context:context + n])], all_logits=True)
                int(out[0][-1].argmax())
                if rnd:
                    best[name][n] = min(best[name][n], clock() - t0)
    return best


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
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the thread's CPU time (needs --threads 1; for a machine shared with busy processes)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    o = ap.parse_args(argv)
    quant = None if o.quantization == "none" else o.quantization
    if o.clock == "cpu" and o.threads != 1:
        ap.error("--clock cpu times this thread only: use it with --threads 1")
    if o.threads:
        torch.set_num_threads(o.threads)
    heads = o.hidden // 64
    base = dict(vocab_size=o.vocab, hidden_size=o.hidden, num_layers=o.layers, num_heads=heads,
                num_kv_heads=max(1, heads // 4), head_dim=64, max_position_embeddings=MAX_LEN)
    moe = ModelArgs(family="moe", intermediate_size=o.expert_intermediate,
                    moe=MoEArgs(o.experts, o.active, o.expert_intermediate, norm_topk_prob=True), **base)
    # the same active parameters per token: one MLP as wide as the active experts together
    dense = ModelArgs(family="dense", intermediate_size=o.active * o.expert_intermediate, **base)
    out = {"threads": torch.get_num_threads(), "clock": o.clock, "quantization": quant,
           "shape": vars(o) | {"json": None}}
    runners = {name: ModelRunner(random_model(args, quant), 1, MAX_LEN, "cpu") for name, args in
               (("dense", dense), ("moe", moe))}
    # the dense model on the Python layers the MoE runs on (not the C++ layer stack): what is the experts' own
    runners["dense_python"] = ModelRunner(random_model(dense, quant), 1, MAX_LEN, "cpu")
    runners["dense_python"].model.fused_layers = False
    rows = list(range(1, K_MAX + 2))
    for ctx in (32, 512):
        cpu0 = cpu_times()
        clock = time.thread_time if o.clock == "cpu" else time.perf_counter
        best = time_passes(runners, rows, ctx, o.rounds, clock)
        busy = other_cpu_share(cpu0, cpu_times())
        for name, table in best.items():
            costs = CostModel()
            for n, sec in table.items():
                costs.add(ctx, n, sec)
            res = {"ms": {n: round(1e3 * sec, 2) for n, sec in table.items()},
                   "ratio_5_to_1": round(table[5] / table[1], 2), "choose_k": policy(costs, ctx),
                   "other_cpu_share": None if busy is None else round(busy, 2)}
            out.setdefault(name, {})[f"ctx{ctx}"] = res
            print(name, f"ctx{ctx}", json.dumps(res))
    if o.json:
        o.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
