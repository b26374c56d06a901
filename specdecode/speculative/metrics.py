"""Speculative-decoding counters with vLLM's definitions."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0          # verification steps that carried at least one draft token
    num_draft_tokens: int = 0    # drafted tokens
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: "SpecDecodeStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos)))
        for i, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += n

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted"""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens emitted per verification pass."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        return [n / self.num_drafts for n in self.accepted_per_pos] if self.num_drafts else []

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
                "per_position_acceptance_rate": self.per_position_acceptance_rate}
