"""The proposer interface: given running requests and a budget k per request, propose draft tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Proposal:
    tokens: list[list[int]]              # per request, 0..k_r draft tokens
    probs: torch.Tensor | None = None    # [R, max_k, V] draft distributions; None means one-hot drafts


class Proposer(Protocol):
    def propose(self, requests: list, ks: list[int]) -> Proposal: ...

    def rollback(self, request, valid_len: int) -> None:
        """The first valid_len tokens of request.all_token_ids are final; forget anything cached past them."""
