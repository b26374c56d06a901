"""What a step costs: target passes by row count and draft passes, at a few context lengths, interpolated.

Drafting k tokens yields 1 + p1 * (1 + q + ... + q^(k-1)) tokens per target pass (``expected_tokens``), with
p1 the rate for the step's first token and q the ``next`` rate (see acceptance.py). That pass costs verify(k+1
rows) plus k draft steps, both timed once when the engine starts (calibration.py) after a short and a long
context, and interpolated to the request's length.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.speculative.adaptive.acceptance import Acceptance, engine_prior


@dataclass
class CostModel:
    """Seconds of a target pass over r rows and of one draft step, at a few context lengths.

    Filled once by ``calibrate`` (or ``add``), not learned online: on a shared machine the speed drifts by
    tens of percent within seconds, and online averages per row count, each taken at a different moment,
    turned that drift into fake differences between k values (a stale dear 5-row reading kept k at 1). The
    calibration times every row count back to back, round after round, and keeps each one's fastest round;
    only the ratios between them matter to ``choose_k``."""
    verify: dict[int, dict[int, float]] = field(default_factory=dict)  # context -> rows -> seconds per pass
    draft: dict[int, float] = field(default_factory=dict)              # context -> seconds per draft step
    # context -> rows -> seconds of a draft pass over that many rows (a batched draft step has one row per
    # drafting request; a catch-up after the draft sat out has one per token it missed)
    draft_rows: dict[int, dict[int, float]] = field(default_factory=dict)
    prior: Acceptance = field(default_factory=engine_prior)         # draft-model acceptance over all requests
    lookup_prior: Acceptance = field(default_factory=engine_prior)  # the same for drafts looked up in the context
    # how busy other processes kept this process's CPUs while the costs were timed (None: not known)
    other_cpu_share: float | None = field(default=None, compare=False)
    # (table, rows) -> {context: seconds}: a step plan prices many row counts, every step (cleared by add*)
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def add(self, context: int, rows: int, seconds: float) -> None:
        self.verify.setdefault(context, {})[rows] = seconds
        self._memo.clear()

    def add_draft(self, context: int, seconds: float, rows: int = 1) -> None:
        if rows == 1:
            self.draft[context] = seconds
        self.draft_rows.setdefault(context, {})[rows] = seconds
        self._memo.clear()

    def _by_context(self, draft: bool, rows: int) -> dict[int, float]:
        key = (draft, rows)
        v = self._memo.get(key)
        if v is None:
            tables = self.draft_rows if draft else self.verify
            v = self._memo[key] = {c: _rows_cost(t, rows) for c, t in tables.items()}
        return v

    def prior_of(self, lookup: bool) -> Acceptance:
        return self.lookup_prior if lookup else self.prior

    def observe_acceptance(self, request: Acceptance, drafted: int, accepted: int, lookup: bool = False) -> None:
        """Record one verification in a request's counts and in the engine-wide ones of its draft kind."""
        self.prior_of(lookup).observe(drafted, accepted, in_run=request.in_run)
        request.observe(drafted, accepted)

    def tokens_per_second(self, p1: float, q: float, k: int, free: bool, context: int = 0) -> float | None:
        """Expected tokens per second of a step drafting k tokens after `context` tokens (free: looked up, no
        draft model passes), with acceptance rates (p1, q); None while costs are not calibrated."""
        verify, step = self.verify_cost(k + 1, context), 0.0 if free else self.draft_cost(context)
        if verify is None or step is None:
            return None
        return expected_tokens(p1, q, k) / (verify + k * step)


    def verify_cost(self, rows: int, context: int = 0) -> float | None:
        """Seconds for a pass over `rows` rows after `context` tokens, interpolated between calibrated row
        counts and contexts, and never below the cost of fewer rows."""
        return _across_contexts(self._by_context(False, rows), context)

    def draft_cost(self, context: int = 0, rows: int = 1) -> float | None:
        """Seconds of a draft pass over `rows` rows after `context` tokens (one step of `rows` requests). Without
        a calibration of several row counts, a batched draft step is taken to cost what one row does."""
        if rows > 1 and any(len(t) > 1 for t in self.draft_rows.values()):
            return _across_contexts(self._by_context(True, rows), context)
        return _across_contexts(self.draft, context)


def _linear(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    return y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)


def _rows_cost(table: dict[int, float], rows: int) -> float:
    known = sorted(table)
    floor = max((table[r] for r in known if r < rows), default=0.0)
    if rows in table:
        return max(floor, table[rows])
    lo = max((r for r in known if r <= rows), default=known[0])
    hi = min((r for r in known if r >= rows), default=known[-1])
    if lo == hi:  # outside the calibrated rows: extrapolate from the two nearest
        if len(known) < 2:
            return max(floor, table[lo])
        lo, hi = known[-2:] if rows > known[-1] else known[:2]
    return max(floor, _linear(rows, lo, table[lo], hi, table[hi]))


def _across_contexts(by_context: dict[int, float], context: int) -> float | None:
    """Linear in the context length (attention work grows linearly), flat below the shortest calibrated
    context, extrapolated (never downwards) beyond the longest."""
    known = sorted(by_context)
    if not known:
        return None
    if len(known) == 1 or context <= known[0]:
        return by_context[known[0]]
    hi = next((c for c in known if c >= context), None)
    if hi is None:
        c0, c1 = known[-2:]
        return max(by_context[c1], _linear(context, c0, by_context[c0], c1, by_context[c1]))
    lo = max(c for c in known if c < context)
    return _linear(context, lo, by_context[lo], hi, by_context[hi])


def expected_tokens(p1: float, q: float, k: int) -> float:
    """Tokens per target pass with k drafts: the target's own token plus 1 + q + ... + q^(k-1) times p1."""
    if k <= 0:
        return 1.0
    run = float(k) if q >= 1.0 else (1.0 - q ** k) / (1.0 - q)
    return 1.0 + p1 * run
