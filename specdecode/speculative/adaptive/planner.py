"""Choosing k: for one request alone (``choose_k``, ``next_k``), and for every request of a step together
(``plan_step``).

The k with the most expected tokens per second wins, k = 0 (plain decoding) whenever the draft is too slow or
too often wrong, so a request drafts short while it is between runs of accepted drafts and deep inside one.
Requests at k = 0 are probed with k = 1 now and then, so a request whose text turns predictable gets
speculation back; each probe that does not bring speculation back doubles the wait before the next one (probes
cost a verify pass, and for a draft model a catch-up pass too).

In a batch, one step verifies every request's rows in one target pass and drafts for all of them in shared
draft passes; both cost more the more rows they carry. Deciding each request's k on its own prices its rows as
if it ran alone, which on a CPU, where a batch of a few requests already makes the target pass compute-bound,
makes speculation lose under load. So ``plan_step`` picks every request's option together, for the most
expected tokens per second of the whole step: where every extra row costs about what a plain token does, the
plan falls back to plain decoding without any hand-set batch-size limit.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from specdecode.speculative.adaptive.acceptance import MAX_PROBE_EVERY, PROBE_EVERY, Acceptance
from specdecode.speculative.adaptive.costs import CostModel

# Leaving plain decoding must promise a clear gain, going deeper a small one: acceptance is an estimate and the
# machine's speed drifts. The first margin is kept small because a draft model declined at a request's first
# step rarely gets another chance: its catch-up grows with every token while the tokens left to repay it shrink.
_MARGIN_OFF, _MARGIN_DEEPER = 1.05, 1.02


def choose_k(p1: float, q: float, k_max: int, costs: CostModel, draft_is_free: bool, context: int = 0) -> int:
    """The k in 0..k_max with the best expected tokens per second after `context` tokens; k_max while
    costs are not calibrated."""
    best = costs.tokens_per_second(p1, q, 0, draft_is_free, context)
    if best is None:
        return k_max
    best_k = 0
    for k in range(1, k_max + 1):
        rate = costs.tokens_per_second(p1, q, k, draft_is_free, context)
        # Demand a margin (see _MARGIN_OFF): a tie is not worth the risk.
        if rate > best * (_MARGIN_OFF if best_k == 0 else _MARGIN_DEEPER):
            best_k, best = k, rate
    return best_k


def next_k(k_max: int, acceptance: Acceptance, costs: CostModel, draft_is_free: bool,
           context: int = 0) -> int:
    """The k for this step of one request's drafts of one kind (free ones are looked up in the context).
    Updates the probing state in ``acceptance``: a chosen k > 0 resets it, a probe doubles the wait."""
    p1, q = acceptance.rates(costs.prior_of(draft_is_free))
    chosen = choose_k(p1, q, k_max, costs, draft_is_free, context)
    if not chosen and acceptance.in_run:
        # Every draft of the last step was accepted. Stopping here would leave the "next" rate (the one a
        # run is judged by) unobserved; a stale low value would then stop every run at its first token.
        chosen = 1
    if chosen:
        acceptance.steps_without_spec, acceptance.probe_every = 0, PROBE_EVERY
        return chosen
    acceptance.steps_without_spec += 1
    if acceptance.steps_without_spec < acceptance.probe_every:
        return 0
    acceptance.steps_without_spec = 0
    acceptance.probe_every = min(2 * acceptance.probe_every, MAX_PROBE_EVERY)
    return 1


# ---- one step's plan for the whole batch ----
@dataclass(frozen=True)
class StepOption:
    """One request's choice for a step: plain (k = 0), a lookup of k tokens, or k draft-model tokens."""
    lookup: bool
    k: int
    tokens: float        # expected tokens emitted (its own token plus accepted drafts)
    once: float = 0.0    # seconds of one-off work this step owes (a draft catch-up, spread over the request)
    fixed: int = 0       # tokens the engine drafts ahead of the option's own (forced text), in tokens and rows
    # Derived, kept as fields: a step's plan reads them tens of thousands of times.
    rows: int = field(init=False, compare=False)         # target rows it verifies
    draft_steps: int = field(init=False, compare=False)  # draft-model passes it needs

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", 1 + self.fixed + self.k)
        object.__setattr__(self, "draft_steps", 0 if self.lookup else self.k)


PLAIN = StepOption(False, 0, 1.0)


def after_forced(opts: list[StepOption], fixed: int) -> list[StepOption]:
    """``opts`` drafted after ``fixed`` forced tokens."""
    return [replace(o, tokens=o.tokens + fixed, fixed=fixed) for o in opts] if fixed else opts


class StepCosts:
    """The step's pass costs by row count at one context, looked up once per row count; the draft's at
    ``draft_context`` where its context is bounded to that (0: the same context)."""

    def __init__(self, costs: CostModel, context: int, draft_context: int = 0):
        self.costs, self.context = costs, context
        self.draft_context = min(context, draft_context) if draft_context else context
        self._verify: dict[int, float] = {}
        self._draft: dict[int, float] = {}

    def verify(self, rows: int) -> float:
        v = self._verify.get(rows)
        if v is None:
            v = self._verify[rows] = self.costs.verify_cost(rows, self.context) or 0.0
        return v

    def draft(self, rows: int) -> float:
        if rows <= 0:
            return 0.0
        v = self._draft.get(rows)
        if v is None:
            v = self._draft[rows] = self.costs.draft_cost(self.draft_context, rows) or 0.0
        return v


def plan_step(options: list[list[StepOption]], costs: CostModel, context: int = 0,
              start: list[int] | None = None, draft_context: int = 0) -> list[int]:
    """Per request, the index of its option (options[i][0] must be plain) that together give the step the
    most expected tokens per second: tokens of all requests / (a target pass over all their rows + the batched
    draft passes + one-off work). Coordinate ascent from a few starts (all plain; each request's best option
    as if it ran alone; ``start``, e.g. the last step's plan; everyone drafting 1 and the most), keeping the
    best end.

    A request leaves plain decoding only if that raises the step's rate by its share (1/B) of a 5% margin, and
    goes deeper only for its share of 2%: acceptance is an estimate and the machine's speed drifts (with one
    request this is choose_k's rule). Uncalibrated costs: a lookup's deepest option, else the draft model's."""
    n = len(options)
    if not n:
        return []
    if costs.verify_cost(1, context) is None:  # as without adaptive k: a lookup found, else the draft's cap
        return [max(range(len(o)), key=lambda j: (o[j].lookup, o[j].k)) for o in options]
    sc = StepCosts(costs, context, draft_context)
    solo = [_best_alone(opts, sc) for opts in options]
    if n == 1:
        return solo
    starts = [[0] * n, solo] + ([list(start)] if start is not None and len(start) == n else [])
    # Draft passes are shared: a draft step that does not pay for one request may pay for all of them, which
    # ascent from one request at a time cannot find. So also start with everyone drafting 1, and the most.
    top = max((o.draft_steps for opts in options for o in opts), default=0)
    for depth in sorted({1, top} - {0}):
        starts.append([_draft_index(opts, depth, j) for opts, j in zip(options, solo)])
    best, best_rate, seen = None, -1.0, set()
    for s in starts:
        s = [min(j, len(o) - 1) for j, o in zip(s, options)]
        if tuple(s) in seen:
            continue
        seen.add(tuple(s))
        plan, rate = _ascend(options, sc, s)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = plan, rate
    return best


class BatchPlan:
    """Running sums of a plan, so that one request's options can all be priced against the others' in
    O(options + draft depth)."""

    def __init__(self, options: list[list[StepOption]], sc: StepCosts, plan: list[int]):
        self.options, self.sc, self.plan = options, sc, list(plan)
        self.tokens = self.once = 0.0
        self.rows = 0
        self.depth = [0] * (1 + max((o.draft_steps for opts in options for o in opts), default=0))
        for i, j in enumerate(plan):
            self._add(options[i][j], 1)

    def _add(self, o: StepOption, sign: int) -> None:
        self.tokens += sign * o.tokens
        self.rows += sign * o.rows
        self.once += sign * o.once
        for s in range(1, o.draft_steps + 1):
            self.depth[s] += sign

    def set(self, i: int, j: int) -> None:
        self._add(self.options[i][self.plan[i]], -1)
        self.plan[i] = j
        self._add(self.options[i][j], 1)

    def rates(self, i: int, opts: list[StepOption] | None = None) -> list[float]:
        """The step's tokens per second with request i's option replaced by each of ``opts`` (default: its
        own options), the others' fixed."""
        opts = opts if opts is not None else self.options[i]
        cur = self.options[i][self.plan[i]]
        tokens, rows, once = self.tokens - cur.tokens, self.rows - cur.rows, self.once - cur.once
        draft, verify = self.sc.draft, self.sc.verify
        # Draft passes without request i, and what its joining them for the first s steps adds (prefix sums).
        others = [self.depth[s] - (s <= cur.draft_steps) for s in range(1, len(self.depth))]
        base = sum(draft(d) for d in others)
        deepest = max(o.draft_steps for o in opts) if opts else 0
        others += [0] * (deepest - len(others))  # deeper than the plan
        join = [0.0]
        for d in others[:deepest]:
            join.append(join[-1] + draft(d + 1) - draft(d))
        base += once
        out = []
        for o in opts:
            seconds = verify(rows + o.rows) + base + join[o.draft_steps] + o.once
            out.append((tokens + o.tokens) / seconds if seconds > 0 else float("inf"))
        return out

    def rate(self) -> float:
        return self.rates(0, [self.options[0][self.plan[0]]])[0]

    def best_for(self, i: int, opts: list[StepOption] | None = None) -> int:
        """Request i's best option index, the others' fixed: leaving plain decoding must gain its share (1/B)
        of a 5% margin, going deeper its share of 2%."""
        rates = self.rates(i, opts)
        share = 1.0 / len(self.plan)
        off, deeper = 1 + (_MARGIN_OFF - 1) * share, 1 + (_MARGIN_DEEPER - 1) * share
        best_j, best = 0, rates[0]
        for j in range(1, len(rates)):
            if rates[j] > best * (off if best_j == 0 else deeper):
                best_j, best = j, rates[j]
        return best_j


def position_options(rates: list[float]) -> list[StepOption]:
    """Lookup options k = 1..len(rates) from each token's chance of acceptance given the ones before it:
    token j is emitted as a draft if all of 0..j are accepted."""
    out, reach, tokens = [], 1.0, 1.0
    for a in rates:
        reach *= max(0.0, min(1.0, a))
        tokens += reach
        out.append(StepOption(True, len(out) + 1, tokens))
    return out


def pays_in_batch(opts: list[StepOption], size: int, sc: StepCosts, plain: StepOption = PLAIN) -> bool:
    """Whether one of ``opts`` beats ``plain`` for a request in a batch of ``size`` plain requests."""
    return BatchPlan([[PLAIN]] * (size - 1) + [[plain] + opts], sc, [0] * size).best_for(size - 1) != 0


def _draft_index(opts: list[StepOption], depth: int, default: int) -> int:
    """The index of the deepest draft-model option of at most ``depth`` tokens, else ``default``."""
    best = default
    for j, o in enumerate(opts):
        if o.draft_steps and o.k <= depth and (not opts[best].draft_steps or o.k > opts[best].k):
            best = j
    return best


def _best_alone(opts: list[StepOption], sc: StepCosts) -> int:
    return BatchPlan([opts], sc, [0]).best_for(0)


def _ascend(options: list[list[StepOption]], sc: StepCosts, plan: list[int], sweeps: int = 3):
    b = BatchPlan(options, sc, plan)
    for _ in range(sweeps):
        changed = False
        for i in range(len(options)):
            j = b.best_for(i)
            if j != b.plan[i]:
                b.set(i, j)
                changed = True
        if not changed:
            break
    return b.plan, b.rate()

