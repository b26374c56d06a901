"""One rejection sampler for a whole batch that mixes greedy and random requests.

Random rows follow Leviathan et al. (2023): accept draft d_i with probability min(1, p(d_i) / q(d_i)); at the
first rejection emit a token from normalise(max(0, p - q)); if every draft is accepted, emit a bonus token
from p at the next position. The emitted sequence is then distributed exactly as sampling from p alone.
Greedy rows accept while the draft equals the target argmax and then emit the target argmax. Seeded requests
take the same path on their probabilities over each position's noise (``PositionNoise``): the argmax of such a
row is a draw from it, fixed by the seed and the position, so their text does not depend on the drafts.
N-gram drafts are one-hot (q(d_i) = 1), which the same formulas cover.
"""
from __future__ import annotations

from collections.abc import Sequence
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


def rejection_sample(target_probs: torch.Tensor | Sequence[torch.Tensor],
                     draft_tokens: torch.Tensor | Sequence[Sequence[int]], num_drafts: list[int],
                     draft_probs: torch.Tensor | None, greedy: list[bool]) -> VerifyResult:
    """target_probs: per request r, its num_drafts[r] + 1 rows after sampling transforms (row j assumes the
    first j drafts were accepted), as a list of [n_r + 1, V] tensors or padded to one [R, K+1, V] tensor; for a
    greedy request, any rows whose argmax is the target's token (a one-hot, or the processed logits themselves);
    draft_tokens: per request its drafts (lists, or [R, K] padded with 0 past num_drafts[r]);
    draft_probs: [R, K, V] or None for one-hot drafts.

    Each request is handled on its own rows: a batch's requests draft different numbers of tokens, and padding
    them all to the deepest one would copy and scan the whole vocabulary for rows nobody reads."""
    drafts = draft_tokens.tolist() if isinstance(draft_tokens, torch.Tensor) else draft_tokens
    tokens, n_acc = [], []
    for r, n in enumerate(num_drafts):
        p, d = target_probs[r][:n + 1], [int(t) for t in drafts[r][:n]]
        if greedy[r]:
            best = argmax(p).tolist()
            a = next((j for j in range(n) if d[j] != best[j]), n)
            final = best[a]
        else:
            a = n
            if n:
                idx = torch.tensor(d, device=p.device)[:, None]
                p_t = p[:n].gather(-1, idx).squeeze(-1)
                p_d = (torch.ones_like(p_t) if draft_probs is None
                       else draft_probs[r, :n].to(p.device).gather(-1, idx).squeeze(-1))
                # One draw per drafted token, from the global generator (a seeded request takes the argmax path)
                u = torch.rand(n, device=p.device)
                ok = accept_mask(p_t, p_d, u).tolist()
                a = next((j for j in range(n) if not ok[j]), n)
            if a < n:
                q = (draft_probs[r, a].to(p.device) if draft_probs is not None
                     else torch.zeros_like(p[a]).index_fill_(0, torch.tensor(d[a], device=p.device), 1.0))
                residual = (p[a] - q).clamp_(min=0)
                final = sample(residual if residual.sum() > 0 else p[a], None)
            else:
                final = sample(p[a], None)
        tokens.append(d[:a] + [final])
        n_acc.append(a)
    return VerifyResult(tokens, n_acc)
