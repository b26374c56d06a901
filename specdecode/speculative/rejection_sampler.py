"""One rejection sampler for a whole batch that mixes greedy and random requests.

Random rows follow Leviathan et al. (2023): accept draft d_i with probability min(1, p(d_i) / q(d_i)); at the
first rejection emit a token from normalise(max(0, p - q)); if every draft is accepted, emit a bonus token
from p at the next position. The emitted sequence is then distributed exactly as sampling from p alone.
Greedy rows accept while the draft equals the target argmax and then emit the target argmax.
N-gram drafts are one-hot (q(d_i) = 1), which the same formulas cover.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.layers.sampler import argmax, sample


@dataclass
class VerifyResult:
    tokens: list[list[int]]   # per request: accepted drafts followed by one recovered/bonus token
    num_accepted: list[int]


def accept_mask(p_target: torch.Tensor, p_draft: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The acceptance test: u < p/q accepts with probability min(1, p/q)."""
    return u * p_draft < p_target


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: list[int],
                     draft_probs: torch.Tensor | None, greedy: list[bool],
                     generators: list[torch.Generator | None]) -> VerifyResult:
    """target_probs: [R, K+1, V] after sampling transforms; for greedy requests, any rows whose argmax is the
    target's token (a one-hot, or the processed logits themselves);
    draft_tokens: [R, K], padded with 0 past num_drafts[r]; draft_probs: [R, K, V] or None for one-hot drafts."""
    R, K1, _ = target_probs.shape
    K = K1 - 1
    dev = target_probs.device
    n_dr = torch.tensor(num_drafts, device=dev)
    valid = torch.arange(K, device=dev)[None, :] < n_dr[:, None]
    d = draft_tokens.long()
    p_t = target_probs[:, :K].gather(-1, d[..., None]).squeeze(-1)
    p_d = torch.ones_like(p_t) if draft_probs is None else draft_probs.gather(-1, d[..., None]).squeeze(-1)
    u = torch.zeros(R, K, device=dev)
    for r in range(R):
        if not greedy[r] and num_drafts[r]:
            # One draw per drafted token from the request's own generator: reproducible in any batch.
            u[r, :num_drafts[r]] = torch.rand(num_drafts[r], generator=generators[r], device=dev)
    greedy_t = torch.tensor(greedy, device=dev)[:, None]
    best = argmax(target_probs) if any(greedy) else None  # [R, K+1]
    ok = torch.where(greedy_t, d == best[:, :K] if best is not None else False, accept_mask(p_t, p_d, u)) & valid
    n_acc = torch.cumprod(ok.int(), dim=1).sum(1).tolist() if K else [0] * R

    tokens = []
    for r in range(R):
        a = n_acc[r]
        accepted = d[r, :a].tolist()
        if greedy[r]:
            final = int(best[r, a])
        elif a < num_drafts[r]:
            p = target_probs[r, a]
            q = draft_probs[r, a] if draft_probs is not None else torch.zeros_like(p).index_fill_(0, d[r, a], 1.0)
            residual = (p - q).clamp_(min=0)
            final = sample(residual if residual.sum() > 0 else p, generators[r])
        else:
            final = sample(target_probs[r, a], generators[r])
        tokens.append(accepted + [final])
    return VerifyResult(tokens, n_acc)
