"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) whose output rows never depend on the other
rows of the pass.

A router scores the experts per token; the token runs through its top-k experts, and their outputs are summed
weighted by the router's probabilities (renormalized over the k where ``norm_topk_prob``). Qwen2-MoE adds a
shared expert that every token runs, scaled by a sigmoid gate.

Why it stays exact (docs/architecture.md): tokens are grouped by expert, but each expert is an ordinary
row-invariant Linear, so a token's expert output is the same whichever other tokens share the call. Each token's
k contributions are then added in one fixed order, ascending expert id (the order transformers' loop uses), so
its sum does not depend on the batch either. Router, softmax, top-k and the weights are all computed per row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from specdecode.layers.activation import get_activation
from specdecode.layers.linear import Linear


@dataclass(frozen=True)
class MoEArgs:
    num_experts: int
    top_k: int
    intermediate_size: int                  # per expert
    norm_topk_prob: bool                    # renormalize the k probabilities to sum to 1
    shared_intermediate_size: int = 0       # Qwen2-MoE's sigmoid-gated shared expert (0: none)
    sparse_layers: tuple[bool, ...] = ()    # per layer: experts (True) or the dense MLP; empty: every layer

    def is_sparse(self, layer: int) -> bool:
        return not self.sparse_layers or self.sparse_layers[layer]


class RouterLinear(Linear):
    """A linear kept at full precision under every quantization: its few outputs choose the experts, and
    llama.cpp's quantizer keeps these weights in float too."""

    def prepare(self, quantization: str | None) -> None:
        super().prepare(None)


class GatedMLP(nn.Module):
    """act(x W_gate) * (x W_up) W_down: one expert (gate and up fused by ``fuse_projections``)."""

    def __init__(self, hidden: int, intermediate: int, activation: str):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.act = get_activation(activation)
        self.gate_up_proj: Linear | None = None

    def fuse_projections(self) -> None:
        self.gate_up_proj = Linear.concat([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, m: MoEArgs, activation: str):
        super().__init__()
        self.m = m
        self.router = RouterLinear(hidden, m.num_experts)
        self.experts = nn.ModuleList(GatedMLP(hidden, m.intermediate_size, activation) for _ in range(m.num_experts))
        if m.shared_intermediate_size:
            self.shared = GatedMLP(hidden, m.shared_intermediate_size, activation)
            self.shared_gate = RouterLinear(hidden, 1)

    def fuse_projections(self) -> None:
        for e in self.experts:
            e.fuse_projections()
        if self.m.shared_intermediate_size:
            self.shared.fuse_projections()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, k] ascending along each row, their weights [N, k] float32)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.m.top_k, dim=-1)
        if self.m.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        ids, order = ids.sort(dim=-1)  # the summation order: ascending expert id
        return ids, weights.gather(-1, order)

    # Eager also under CausalLM.compile_decode: the per-expert groups have data-dependent sizes, and a graph
    # specialized to a group of one could round differently from the general one.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = x.shape[0], self.m.top_k
        ids, weights = self.route(x)
        parts = x.new_empty(n, k, x.shape[-1])
        for e in torch.unique(ids).tolist():  # every (token, slot) routed to e, through e's linears at once
            tokens, slots = (ids == e).nonzero(as_tuple=True)
            y = self.experts[e](x[tokens])
            parts[tokens, slots] = y * weights[tokens, slots, None].to(y.dtype)
        out = parts[:, 0]
        for j in range(1, k):
            out = out + parts[:, j]
        if self.m.shared_intermediate_size:
            shared = self.shared(x)
            # The gate's sigmoid over a full row per token: over the [N, 1] column, which of the N values fell in
            # the vectorized loop's scalar tail (rounded differently) would depend on N.
            gate = torch.sigmoid(self.shared_gate(x).expand_as(shared).contiguous())
            out = out + gate * shared
        return out
