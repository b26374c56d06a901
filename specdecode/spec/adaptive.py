"""Choose k per request so that speculation never costs more than it gains.

With per-token acceptance probability a, drafting k tokens yields (1 - a^(k+1)) / (1 - a) tokens per target
pass. That pass costs verify(k+1 rows) plus k draft steps. We measure both costs online, keep an
exponential average of each request's acceptance, and pick the k with the most tokens per second; k = 0
(plain decoding) wins whenever the draft is too slow or too often wrong. Requests at k = 0 are probed with
k = 1 now and then, so a request whose text turns predictable gets speculation back; each probe that does
not bring speculation back doubles the wait before the next one (probes cost a verify pass, and for a draft
model a catch-up pass too). A new request starts from the acceptance seen on earlier ones, not a guess.
"""
from __future__ import annotations

from dataclasses import dataclass, field

_EMA = 0.3
_PRIOR_EMA = 0.05
_MARGIN_OFF, _MARGIN_DEEPER = 1.10, 1.02
PROBE_EVERY = 8        # steps at k = 0 before the first probe
MAX_PROBE_EVERY = 64


@dataclass
class CostModel:
    verify: dict[int, float] = field(default_factory=dict)  # rows per request -> seconds per pass
    draft_step: float | None = None                          # seconds per draft step
    accept_prior: float = 0.7                                # acceptance a new request starts from

    def observe_verify(self, rows: int, seconds: float) -> None:
        old = self.verify.get(rows)
        self.verify[rows] = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def observe_draft(self, seconds: float) -> None:
        """One steady-state draft pass (one new token per request)."""
        old = self.draft_step
        self.draft_step = seconds if old is None else (1 - _EMA) * old + _EMA * seconds

    def observe_acceptance(self, drafted: int, accepted: int) -> None:
        """Slow average over all requests of the per-token acceptance estimate."""
        if drafted > 0:
            self.accept_prior = (1 - _PRIOR_EMA) * self.accept_prior + _PRIOR_EMA * _acceptance_sample(drafted, accepted)

    def verify_cost(self, rows: int) -> float | None:
        if rows in self.verify:
            return self.verify[rows]
        known = sorted(self.verify)
        if not known:
            return None
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


def expected_tokens(a: float, k: int) -> float:
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def choose_k(a: float, k_max: int, costs: CostModel, draft_is_free: bool) -> int:
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
        rate = expected_tokens(a, k) / (v + k * step)
        # Demand a margin: costs are measured on a noisy machine and acceptance is an estimate, so leaving
        # plain decoding must promise a clear gain (10%), and a deeper k a small one (2%).
        if rate > best * (_MARGIN_OFF if best_k == 0 else _MARGIN_DEEPER):
            best_k, best = k, rate
    return best_k


def update_acceptance(prev: float | None, drafted: int, accepted: int) -> float:
    """Per-token acceptance estimate from one verification (a run of `accepted` then a rejection, or all)."""
    if drafted <= 0:
        return prev if prev is not None else 0.7
    sample = _acceptance_sample(drafted, accepted)
    return sample if prev is None else (1 - _EMA) * prev + _EMA * sample


def _acceptance_sample(drafted: int, accepted: int) -> float:
    # A run of `accepted` ended by a rejection is the geometric estimate accepted / (accepted + 1);
    # a fully accepted run only says "high".
    return 1.0 if accepted == drafted else accepted / (accepted + 1)


def next_k(k_max: int, accept: float | None, costs: CostModel, draft_is_free: bool, state) -> int:
    """The k for this step of one request. ``state`` carries ``steps_without_spec`` and ``probe_every``
    (a Request) and is updated: a chosen k > 0 resets probing, a probe doubles the wait for the next."""
    chosen = choose_k(costs.accept_prior if accept is None else accept, k_max, costs, draft_is_free)
    if chosen:
        state.steps_without_spec, state.probe_every = 0, PROBE_EVERY
        return chosen
    state.steps_without_spec += 1
    if state.steps_without_spec < state.probe_every:
        return 0
    state.steps_without_spec = 0
    state.probe_every = min(2 * state.probe_every, MAX_PROBE_EVERY)
    return 1
