"""Choose k per request so that speculation never costs more than it gains.

Acceptance is not independent from token to token: drafts come in runs (a copied span, a stretch of
boilerplate code) and a rejection usually ends one. So each request keeps two rates, from decayed counts:
``first``, the chance that the first draft token after a rejection (or a plain step) is accepted, and
``next``, the chance that a draft token following an accepted token is accepted too; after a fully accepted
verification the next step's first token counts as a ``next`` one. Drafting k tokens then yields
1 + p1 * (1 + q + ... + q^(k-1)) tokens per target pass, with p1 the rate for the step's first token and q
the ``next`` rate. That pass costs verify(k+1 rows) plus k draft steps; both are measured online, and the
k with the most tokens per second wins, k = 0 (plain decoding) whenever the draft is too slow or too often
wrong. So a request drafts short while it is between runs and deep inside one.

Requests at k = 0 are probed with k = 1 now and then, so a request whose text turns predictable gets
speculation back; each probe that does not bring speculation back doubles the wait before the next one
(probes cost a verify pass, and for a draft model a catch-up pass too). A new request's rates start from
the counts seen on earlier requests, not a guess.
"""
from __future__ import annotations

from dataclasses import dataclass, field

_EMA = 0.3
_REQUEST_DECAY = 0.8   # per verification: a request's counts follow its text as it changes
_PRIOR_DECAY = 0.98    # the engine-wide counts new requests start from
_PRIOR_WEIGHT = 2.0    # pseudo-trials of the engine-wide rate in a request's estimate
_MARGIN_OFF, _MARGIN_DEEPER = 1.10, 1.02
PROBE_EVERY = 8        # steps at k = 0 before the first probe
MAX_PROBE_EVERY = 64


@dataclass
class Acceptance:
    """Decayed success / trial counts of the two kinds of draft token (see the module docstring)."""
    decay: float = _REQUEST_DECAY
    first_ok: float = 0.0
    first_n: float = 0.0
    next_ok: float = 0.0
    next_n: float = 0.0
    in_run: bool = False  # the last verification accepted every draft token

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
        pf, pn = prior.kind_rates() if prior is not None else (0.7, 0.7)
        w = _PRIOR_WEIGHT if prior is not None else 0.0
        first = (self.first_ok + w * pf) / (self.first_n + w) if self.first_n + w > 0 else pf
        nxt = (self.next_ok + w * pn) / (self.next_n + w) if self.next_n + w > 0 else pn
        return first, nxt

    def rates(self, prior: "Acceptance | None" = None) -> tuple[float, float]:
        """(p1, q): the acceptance chance of this step's first draft token, and of each one after it."""
        first, nxt = self.kind_rates(prior)
        return (nxt if self.in_run else first), nxt


def _prior() -> Acceptance:
    # One pseudo-trial at 0.7 each until real verifications come in.
    return Acceptance(decay=_PRIOR_DECAY, first_ok=0.7, first_n=1.0, next_ok=0.7, next_n=1.0)


@dataclass
class CostModel:
    verify: dict[int, float] = field(default_factory=dict)  # rows per request -> seconds per pass
    draft_step: float | None = None                          # seconds per draft step
    prior: Acceptance = field(default_factory=_prior)        # acceptance counts over all requests

    def observe_verify(self, rows: int, seconds: float) -> None:
        old = self.verify.get(rows)
        self.verify[rows] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def observe_draft(self, seconds: float) -> None:
        """One steady-state draft pass (one new token per request)."""
        old = self.draft_step
        self.draft_step = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def observe_acceptance(self, request: Acceptance, drafted: int, accepted: int) -> None:
        """Record one verification in a request's counts and in the engine-wide ones."""
        self.prior.observe(drafted, accepted, in_run=request.in_run)
        request.observe(drafted, accepted)

    def verify_cost(self, rows: int) -> float | None:
        """Seconds for a pass over `rows` rows: measured or interpolated, and never below the cost of
        fewer rows (a pass over more rows cannot be cheaper; a noisy low reading must not lure k up)."""
        known = sorted(self.verify)
        if not known:
            return None
        floor = max((self.verify[r] for r in known if r < rows), default=0.0)
        return max(floor, self._interpolated(rows, known))

    def _interpolated(self, rows: int, known: list[int]) -> float:
        if rows in self.verify:
            return self.verify[rows]
        # Interpolate linearly between measured row counts (extrapolate from the two nearest).
        lo = max((r for r in known if r <= rows), default=known[0])
        hi = min((r for r in known if r >= rows), default=known[-1])
        if lo == hi:
            if len(known) < 2:
                return self.verify[lo]
            a, b = known[-2:] if rows > known[-1] else known[:2]
            lo, hi = a, b
        t = (rows - lo) / (hi - lo)
        return self.verify[lo] + t * (self.verify[hi] - self.verify[lo])


def expected_tokens(p1: float, q: float, k: int) -> float:
    """Tokens per target pass with k drafts: the target's own token plus 1 + q + ... + q^(k-1) times p1."""
    if k <= 0:
        return 1.0
    run = float(k) if q >= 1.0 else (1.0 - q ** k) / (1.0 - q)
    return 1.0 + p1 * run


def choose_k(p1: float, q: float, k_max: int, costs: CostModel, draft_is_free: bool) -> int:
    """The k in 0..k_max with the best expected tokens per second; k_max while costs are unmeasured."""
    base = costs.verify_cost(1)
    step = 0.0 if draft_is_free else costs.draft_step
    if base is None or step is None:
        return k_max
    best_k, best = 0, 1.0 / base
    for k in range(1, k_max + 1):
        v = costs.verify_cost(k + 1)
        if v is None:
            return k_max
        rate = expected_tokens(p1, q, k) / (v + k * step)
        # Demand a margin: costs are measured on a noisy machine and acceptance is an estimate, so leaving
        # plain decoding must promise a clear gain (10%), and a deeper k a small one (2%).
        if rate > best * (_MARGIN_OFF if best_k == 0 else _MARGIN_DEEPER):
            best_k, best = k, rate
    return best_k


def next_k(k_max: int, acceptance: Acceptance, costs: CostModel, draft_is_free: bool, state) -> int:
    """The k for this step of one request. ``state`` carries ``steps_without_spec`` and ``probe_every``
    (a Request) and is updated: a chosen k > 0 resets probing, a probe doubles the wait for the next."""
    p1, q = acceptance.rates(costs.prior)
    chosen = choose_k(p1, q, k_max, costs, draft_is_free)
    if chosen:
        state.steps_without_spec, state.probe_every = 0, PROBE_EVERY
        return chosen
    state.steps_without_spec += 1
    if state.steps_without_spec < state.probe_every:
        return 0
    state.steps_without_spec = 0
    state.probe_every = min(2 * state.probe_every, MAX_PROBE_EVERY)
    return 1
