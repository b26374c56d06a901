"""What speculation keeps about one request (``Request.spec``), declared in one place so that it goes when the
request goes: the adaptive-k policy's counts and plan, and the proposers' per-request lookups."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdecode.speculative.adaptive.acceptance import Acceptance

if TYPE_CHECKING:
    from specdecode.speculative.suffix import LocalIndex


@dataclass
class DraftSources:
    """Where one step's drafts for a request came from (HybridProposer), so that observe() credits each kind."""
    looked_up: bool = False         # the drafts were looked up in the context
    found: list[int] | None = None  # the lookup that matched at the step's start, used or not
    copied_from: int | None = None  # where a copy opened by the draft model's tokens begins


@dataclass
class SpecState:
    """One request's speculative state. The proposers and their policy own it; the engine only creates it."""
    # AdaptiveK: this request's acceptance of draft-model drafts and of drafts looked up in its context, and the
    # target's top probability at its latest steps' first positions (Proposer.note_target), latest last
    acceptance: Acceptance = field(default_factory=Acceptance)
    lookup_acceptance: Acceptance = field(default_factory=Acceptance)
    confidence: list[float] = field(default_factory=list)
    plan: tuple[bool, int] | None = None  # the last step's (looked_up, k): where the next step's plan starts
    draft_warm_up: bool = False  # this step looks up, and the draft model catches up meanwhile (AdaptiveK.plan)
    finished: bool = False       # AdaptiveK.finished has counted its length (once, however many proposers report)
    # HybridProposer: this step's draft sources (None between steps)
    sources: DraftSources | None = None
    # SuffixProposer: the index of the request's own tokens, and its last lookup from the request's context with
    # each token's evidence (share, occurrences, match length), kept until the verification scores it
    suffix_index: LocalIndex | None = None
    suffix_found: tuple[list[int], list[tuple[float, int, int]]] | None = None
