"""The proposer interface: given running requests and a budget k per request, propose draft tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Proposal:
    tokens: list[list[int]]              # per request, 0..k_r draft tokens
    probs: torch.Tensor | None = None    # [R, max_k, V] draft distributions; None means one-hot drafts
    # Seconds of each steady-state draft pass (one new token per request), for the adaptive cost model.
    # Catch-up passes over many tokens (after a stretch without drafting) are left out: counted as a draft
    # step they would make drafting look dearer than it is and keep speculation off.
    step_seconds: list[float] = field(default_factory=list)


class Proposer(Protocol):
    def propose(self, requests: list, ks: list[int]) -> Proposal: ...

    def rollback(self, request, valid_len: int) -> None:
        """The first valid_len tokens of request.all_token_ids are final; forget anything cached past them."""
