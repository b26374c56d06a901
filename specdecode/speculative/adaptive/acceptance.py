"""How often drafts are accepted: per request and engine-wide, per draft kind, and by the target's confidence.

Acceptance is not independent from token to token: drafts come in runs (a copied span, a stretch of
boilerplate code) and a rejection usually ends one. So each request keeps two rates, from decayed counts:
``first``, the chance that the first draft token after a rejection (or a plain step) is accepted, and
``next``, the chance that a draft token following an accepted token is accepted too; after a fully accepted
verification the next step's first token counts as a ``next`` one. A new request's rates start from the
counts seen on earlier requests (``engine_prior``), not a guess.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

_REQUEST_DECAY = 0.8   # per verification: a request's counts follow its text as it changes
PRIOR_DECAY = 0.98    # the engine-wide counts new requests start from
_PRIOR_WEIGHT = 2.0    # pseudo-trials of the engine-wide rate in a request's estimate
_NEUTRAL_WEIGHT = 1.0  # pseudo-trials at 0.7 in the engine-wide estimate
PROBE_EVERY = 8        # steps at k = 0 before the first probe
MAX_PROBE_EVERY = 64   # the longest wait between probes (each unfruitful one doubles it)

# The target's confidence (its top probability) at a position predicts whether the draft model's token there is
# accepted, so a request's recent confidences say how well the draft model would do on it before it drafts.
_CONFIDENCE_BANDS = (0.3, 0.5, 0.7, 0.9, 0.99)
CONFIDENCE_WINDOW = 8      # a request's latest steps whose confidence stands for its text
_CONFIDENCE_DECAY = 0.995  # per observation of a band: the draft model's acceptance in it, over recent requests
_CONFIDENCE_PRIOR = 4.0    # pseudo-trials at the band's own confidence before any are seen


@dataclass
class Acceptance:
    """Decayed success / trial counts of the two kinds of draft token (see the module docstring)."""
    decay: float = _REQUEST_DECAY
    first_ok: float = 0.0
    first_n: float = 0.0
    next_ok: float = 0.0
    next_n: float = 0.0
    in_run: bool = False  # the last verification accepted every draft token
    steps_without_spec: int = 0       # probing while k = 0 (see next_k)
    probe_every: int = PROBE_EVERY

    def observe(self, drafted: int, accepted: int, in_run: bool | None = None) -> None:
        """One verification of `drafted` tokens of which the first `accepted` were kept (`in_run`: whether
        it followed a fully accepted one; by default this request's own state). drafted = 0 (a plain step)
        ends any run."""
        in_run = self.in_run if in_run is None else in_run
        self.in_run = 0 < drafted == accepted
        if drafted <= 0:
            return
        d = self.decay
        self.first_ok, self.first_n, self.next_ok, self.next_n = (d * self.first_ok, d * self.first_n,
                                                                  d * self.next_ok, d * self.next_n)
        tried = min(accepted + 1, drafted)  # positions 1..accepted passed; the one after (if any) failed
        if in_run:
            self.next_ok += accepted
            self.next_n += tried
        else:
            self.first_n += 1
            self.first_ok += accepted >= 1
            self.next_ok += max(0, accepted - 1)
            self.next_n += tried - 1

    def kind_rates(self, prior: "Acceptance | None" = None) -> tuple[float, float]:
        """(first, next) rates; with a prior, each is smoothed by _PRIOR_WEIGHT pseudo-trials of its rates."""
        # Without a prior (the engine-wide counts themselves): a fixed pseudo-trial at 0.7 that never decays,
        # so a rate nobody observes any more drifts back to a neutral guess instead of freezing.
        pf, pn = prior.kind_rates() if prior is not None else (0.7, 0.7)
        w = _PRIOR_WEIGHT if prior is not None else _NEUTRAL_WEIGHT
        first = (self.first_ok + w * pf) / (self.first_n + w) if self.first_n + w > 0 else pf
        nxt = (self.next_ok + w * pn) / (self.next_n + w) if self.next_n + w > 0 else pn
        return first, nxt

    def fade(self, keep: float) -> None:
        """Keep ``keep`` of the counts: what they say weighs less against the neutral guess."""
        self.first_ok, self.first_n, self.next_ok, self.next_n = (keep * self.first_ok, keep * self.first_n,
                                                                  keep * self.next_ok, keep * self.next_n)

    def rates(self, prior: "Acceptance | None" = None) -> tuple[float, float]:
        """(p1, q): the acceptance chance of this step's first draft token, and of each one after it."""
        first, nxt = self.kind_rates(prior)
        return (nxt if self.in_run else first), nxt


def engine_prior() -> Acceptance:
    """Engine-wide counts of one draft kind, before any verification."""
    return Acceptance(decay=PRIOR_DECAY)  # the neutral pseudo-trial stands in until verifications come in


class ConfidenceRates:
    """How often the draft model's first token of a step is accepted, by the target's confidence (its top
    probability) at that position, learned from verifications in bands of confidence, apart for a step that
    starts inside a run of accepted drafts and one that does not (Acceptance's "next" and "first"). A request's
    expected acceptance is then the rate of the confidences of its latest positions: text the target is sure of
    (arithmetic, code, a list the prompt spells out) is text a small model of its family guesses, and text it
    hesitates over (open prose, a translation's word choice) is not. This is what a request that has not
    drafted yet is judged by, instead of the engine-wide rate of whatever requests came before it."""

    def __init__(self):
        # (in a run, band) -> (accepted, tried)
        self.counts = {(run, b): (0.0, 0.0) for run in (False, True) for b in range(len(_CONFIDENCE_BANDS) + 1)}

    def rate(self, confidence: float, in_run: bool = False) -> float:
        ok, n = self.counts[in_run, bisect.bisect_right(_CONFIDENCE_BANDS, confidence)]
        return (ok + _CONFIDENCE_PRIOR * confidence) / (n + _CONFIDENCE_PRIOR)

    def observe(self, confidence: float, accepted: bool, in_run: bool = False) -> None:
        key = in_run, bisect.bisect_right(_CONFIDENCE_BANDS, confidence)
        ok, n = self.counts[key]
        self.counts[key] = (_CONFIDENCE_DECAY * ok + accepted, _CONFIDENCE_DECAY * n + 1.0)

    def best_rate(self) -> float:
        """The highest rate any confidence can be given (each band's at its top): what no request's prior exceeds."""
        tops = _CONFIDENCE_BANDS + (1.0,)
        return max(self.rate(tops[b], run) for run, b in self.counts)

    def prior(self, confidences: list[float], engine: Acceptance) -> "_Fixed":
        """The draft-model prior of a request whose latest confidences are ``confidences``: per kind, the mean
        rate of its confidences, with the engine-wide rate as one more of them."""
        first, nxt = engine.kind_rates()
        n = len(confidences) + 1
        return _Fixed((sum(self.rate(c) for c in confidences) + first) / n,
                      (sum(self.rate(c, True) for c in confidences) + nxt) / n)


@dataclass
class _Fixed:
    """Fixed (first, next) rates with Acceptance's ``kind_rates``: a prior that is computed, not counted."""
    first: float
    next: float

    def kind_rates(self, prior=None) -> tuple[float, float]:
        return self.first, self.next

