"""Choose k per request so that speculation never costs more than it gains.

Acceptance is not independent from token to token: drafts come in runs (a copied span, a stretch of
boilerplate code) and a rejection usually ends one. So each request keeps two rates, from decayed counts:
``first``, the chance that the first draft token after a rejection (or a plain step) is accepted, and
``next``, the chance that a draft token following an accepted token is accepted too; after a fully accepted
verification the next step's first token counts as a ``next`` one. Drafting k tokens then yields
1 + p1 * (1 + q + ... + q^(k-1)) tokens per target pass, with p1 the rate for the step's first token and q
the ``next`` rate. That pass costs verify(k+1 rows) plus k draft steps, both timed once when the engine starts
(``calibrate``) after a short and a long context, and interpolated to the request's length; the k with
the most tokens per second wins, k = 0 (plain decoding) whenever the draft is too slow or too often
wrong. So a request drafts short while it is between runs and deep inside one.

Requests at k = 0 are probed with k = 1 now and then, so a request whose text turns predictable gets
speculation back; each probe that does not bring speculation back doubles the wait before the next one
(probes cost a verify pass, and for a draft model a catch-up pass too). A new request's rates start from
the counts seen on earlier requests, not a guess.

Drafts looked up in the prompt (n-gram) and drafts from a draft model succeed at very different rates in
the same text, so each kind has its own counts, its own probing and its own engine-wide prior; with
``ngram_first`` a request may look up deep while its draft model is off, or the other way round.

In a batch, one step verifies every request's rows in one target pass and drafts for all of them in shared
draft passes, so k is chosen for the whole step at once (``plan_step``): the cost is the target pass over the
batch's total rows plus the batched draft passes, both calibrated by row count up to the engine's batch, and
the plan is the set of per-request choices with the most expected tokens per second for the step. Where the
batch makes the target pass compute-bound (a few requests on a CPU), every extra row costs about what a plain
token does, and the plan falls back to plain decoding without any hand-set batch-size limit. The draft
model's first pass for a request feeds every token it has not seen (its prompt, the first time): that
one-off cost is spread over the tokens the request is all but sure to have left (its budget, and the lengths
of finished requests that ran as long as it has), so a short answer never pays for a draft prefill it cannot
earn back: where some answers are short, the draft model starts once a request has outlived them.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("specdecode")

_REQUEST_DECAY = 0.8   # per verification: a request's counts follow its text as it changes
_PRIOR_DECAY = 0.98    # the engine-wide counts new requests start from
_PRIOR_WEIGHT = 2.0    # pseudo-trials of the engine-wide rate in a request's estimate
_NEUTRAL_WEIGHT = 1.0  # pseudo-trials at 0.7 in the engine-wide estimate
# Leaving plain decoding must promise a clear gain, going deeper a small one: acceptance is an estimate and the
# machine's speed drifts. The first margin is kept small because a draft model declined at a request's first
# step rarely gets another chance: its catch-up grows with every token while the tokens left to repay it shrink.
_MARGIN_OFF, _MARGIN_DEEPER = 1.05, 1.02
# Per request step in which the draft model did not draft: how much of the engine-wide draft-model counts is
# kept. A draft model that sat out must first catch up on a request's whole context, which a low engine-wide
# rate never pays for, so without this one bad stretch of requests would switch it off for good (nothing new
# would be observed). This way the counts fade to the neutral guess over a few hundred such steps (a few long
# answers, many more short ones) and a later request tries the draft model again.
_IDLE_KEEP = 0.99
PROBE_EVERY = 8        # steps at k = 0 before the first probe
MAX_PROBE_EVERY = 64
_LEN_PRIOR, _LEN_PRIOR_WEIGHT = 128.0, 2.0  # output tokens a request is taken to run before any has finished
_MIN_LEFT = 16.0
_LEN_WINDOW = 128      # finished requests whose lengths are kept (older ones weigh < 0.1 by then)
_ASSURED = 0.9         # a one-off draft catch-up must pay back within what this share of requests runs on
# A finished answer of L tokens that ended by itself stands for answers of L .. 2L (log-uniform, as points): a
# request that has just outlived the short answers seen so far is still likely to be one of them, while one that
# has not reached L yet is not taken to end any sooner than L.
_LEN_SPREAD = tuple(2.0 ** (j / 4) for j in range(5))
_PEAK_DECAY = 0.98     # per step: how fast the remembered batch size falls back after the batch shrinks
# The target's confidence (its top probability) at a position predicts whether the draft model's token there is
# accepted, so a request's recent confidences say how well the draft model would do on it before it drafts.
_CONFIDENCE_BANDS = (0.3, 0.5, 0.7, 0.9, 0.99)
_CONFIDENCE_WINDOW = 8     # a request's latest steps whose confidence stands for its text
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


def _prior() -> Acceptance:
    return Acceptance(decay=_PRIOR_DECAY)  # the neutral pseudo-trial stands in until verifications come in


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
    prior: Acceptance = field(default_factory=_prior)         # draft-model acceptance over all requests
    lookup_prior: Acceptance = field(default_factory=_prior)  # the same for drafts looked up in the context
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

    def expected_rate(self, acceptance: Acceptance, k: int, free: bool, context: int = 0) -> float:
        """tokens_per_second from one draft kind's acceptance; 0 while costs are not calibrated."""
        return self.tokens_per_second(*acceptance.rates(self.prior_of(free)), k, free, context) or 0.0

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


MAX_CALIBRATED_ROWS = 256  # beyond this a pass's cost is extrapolated (it is linear in the rows by then)
_BIG = 16                  # passes over more rows are timed fewer times: they last long enough to be steady


def calibration_rows(k_max: int, batch: int = 1) -> list[int]:
    """Row counts of the target passes ``calibrate`` times: 1-3, then doubling, and k_max + 1 (one request's
    verification); with a batch of more than one request, also ``batch`` (a plain step of all of them) and
    doubling on to batch * (k_max + 1) (every request drafting k_max), at most MAX_CALIBRATED_ROWS. The rest is
    interpolated."""
    rows, r = {1, 2, 3, k_max + 1}, 3
    while r < k_max + 1:
        r = 2 * r - 1
        rows.add(min(r, k_max + 1))
    rows = {x for x in rows if x <= k_max + 1}
    if batch > 1:
        top = min(batch * (k_max + 1), MAX_CALIBRATED_ROWS)
        rows.add(min(batch, top))
        r = k_max + 1
        while r < top:
            r = min(2 * r, top)
            rows.add(r)
    return sorted(rows)


def draft_calibration_rows(batch: int = 1) -> list[int]:
    """Row counts of the draft passes ``calibrate`` times: one batched draft step per power of two up to
    ``batch`` requests, and a long pass (what catching up on many missed tokens, or a draft prefill, costs)."""
    rows, r = {1}, 1
    while r < batch:
        r = min(2 * r, batch)
        rows.add(r)
    return sorted(rows | {64})


def _cpu_times() -> tuple[int, int, int] | None:
    """(busy ticks of the CPUs this process may run on, all their ticks, this process's own ticks), from
    /proc; None where /proc is not there."""
    try:
        cpus = os.sched_getaffinity(0)
        busy = total = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                    continue
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                total += sum(ticks)
                busy += sum(ticks) - ticks[3] - ticks[4]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        return busy, total, int(own[11]) + int(own[12])  # utime, stime
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def other_cpu_share(before: tuple[int, int, int] | None, after: tuple[int, int, int] | None) -> float | None:
    """The share of this process's CPUs that other processes (or a hypervisor's steal) used between two
    _cpu_times() readings: 0 on a quiet machine, 0.5 when another busy process holds one of two cores."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    others = (after[0] - before[0]) - (after[2] - before[2])
    return max(0.0, min(1.0, others / (after[1] - before[1])))


# A calibration during which other processes used more than this share of our CPUs is used for this run but
# not stored: contention slows the short passes (a draft step) by more than the long ones, so the stored
# ratios would keep speculation off on every later start.
MAX_OTHER_CPU_SHARE = 0.2


def calibrate(target, draft, k_max: int, max_len: int, repeats: int = 5,
              contexts: tuple[int, ...] = (32, 512), batch: int = 1) -> CostModel:
    """Time target passes over the rows of calibration_rows(k_max, batch) and, with a draft runner, draft
    passes over draft_calibration_rows(batch), after each of a short and a long context, on cache slot 0 (call
    it while no request runs: the slot's content is left as scratch). Each round times every row count back
    to back, after one untimed warm-up round; passes over many rows are timed once. Rows of one
    slot stand in for rows of many requests: the weights are read once per pass either way. The result's
    ``other_cpu_share`` says how busy the rest of the machine was meanwhile."""
    import torch

    k_max = max(1, min(k_max, max_len - 2))  # a context of at least 1 plus k_max + 1 rows must fit
    costs = CostModel()
    gen = torch.Generator().manual_seed(0)
    vocab = min(target.vocab_size, draft.vocab_size if draft is not None else target.vocab_size)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    runners = [target] + ([draft] if draft is not None else [])
    cpu0 = _cpu_times()
    for ctx in sorted({max(1, min(c, max_len - k_max - 2)) for c in contexts}):
        sizes = [n for n in calibration_rows(k_max, batch) if ctx + n <= max_len]
        dsizes = [n for n in draft_calibration_rows(batch) if ctx + n <= max_len] if draft is not None else []
        passes = [(False, target, n) for n in sizes] + [(True, draft, n) for n in dsizes]
        ids = torch.randint(0, vocab, (ctx + max(sizes + dsizes),), generator=gen).tolist()
        with torch.inference_mode():
            # A real prefill, not just any content: its seconds of full-speed work also bring the process up
            # to the speed it keeps (timed without it, a fresh process's passes ran 15-45% slower).
            for runner in runners:
                runner.prefill(0, ids[:ctx])
            times: dict[tuple[bool, int], list[float]] = {(d, n): [] for d, _, n in passes}
            for rnd in range(repeats + 1):
                for is_draft, runner, n in passes:
                    if n > _BIG and rnd != 1:
                        continue  # long enough to be steady in one go, after the small passes warmed up
                    # a verification needs every row's logits; a draft step one per request, a catch-up one
                    all_logits = not is_draft or n <= batch
                    sync()
                    t0 = time.perf_counter()
                    out = runner.forward_rows([(0, ctx, ids[ctx:ctx + n])], all_logits=all_logits)
                    int(out[0][-1].argmax())  # the step's own use of its logits (and a device sync)
                    if rnd:
                        times[(is_draft, n)].append(time.perf_counter() - t0)
        # Each cost is its fastest round. Interference from other work on the machine only ever slows a
        # pass down, so the minimum is the steadiest estimate of a pass's own cost (medians of per-round
        # ratios still moved the draft/verify ratio by 0.26-0.41 between calibrations).
        for (is_draft, n), ts in times.items():
            if ts:
                if is_draft:
                    costs.add_draft(ctx, min(ts), n)
                else:
                    costs.add(ctx, n, min(ts))
    costs.other_cpu_share = other_cpu_share(cpu0, _cpu_times())
    return costs


def expected_tokens(p1: float, q: float, k: int) -> float:
    """Tokens per target pass with k drafts: the target's own token plus 1 + q + ... + q^(k-1) times p1."""
    if k <= 0:
        return 1.0
    run = float(k) if q >= 1.0 else (1.0 - q ** k) / (1.0 - q)
    return 1.0 + p1 * run


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
# A step runs one target pass over every request's rows and, if any request drafts with the draft model, a
# few batched draft passes; both cost more the more rows they carry. Deciding each request's k on its own (as
# choose_k does for one request) prices its rows as if it ran alone, which on a CPU, where a batch of a few
# requests already makes the target pass compute-bound, makes speculation lose under load. So the plan
# picks every request's option together, for the most expected tokens per second of the whole step.

OPTIMISTIC_RATE = 0.9  # acceptance that would make drafting pay, for "is it the acceptance that says no?"


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


def prefix_length(r) -> int:
    """How many tokens the engine drafts for r this step ahead of the proposer's (``draft_prefix``, the text
    its grammar forces; see proposer.context_of). Every option of r verifies them, and they are counted as
    emitted: the grammar allows nothing else."""
    return len(getattr(r, "draft_prefix", None) or ())


def _free_share(r) -> float:
    """The share of r's output that its grammar does not force (1 without a grammar), judged by its output so
    far and this step's forced text: only those tokens are drafted by the proposer, so only they repay a
    draft model's catch-up."""
    forced = getattr(r, "num_forced", 0) + prefix_length(r)
    if not forced:
        return 1.0
    return max(0.05, 1.0 - forced / max(1, getattr(r, "num_output_tokens", 0) + prefix_length(r)))


def _after(opts: list[StepOption], fixed: int) -> list[StepOption]:
    """``opts`` drafted after ``fixed`` forced tokens."""
    return [replace(o, tokens=o.tokens + fixed, fixed=fixed) for o in opts] if fixed else opts


def _plain(r) -> StepOption:
    """r's plain option: no drafts of the proposer's (forced text is still verified)."""
    return _after([PLAIN], prefix_length(r))[0]


class _StepCosts:
    """The step's pass costs by row count at one context, looked up once per row count."""

    def __init__(self, costs: CostModel, context: int):
        self.costs, self.context = costs, context
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
            v = self._draft[rows] = self.costs.draft_cost(self.context, rows) or 0.0
        return v


def plan_step(options: list[list[StepOption]], costs: CostModel, context: int = 0,
              start: list[int] | None = None) -> list[int]:
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
    sc = _StepCosts(costs, context)
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


class _Batch:
    """Running sums of a plan, so that one request's options can all be priced against the others' in
    O(options + draft depth)."""

    def __init__(self, options: list[list[StepOption]], sc: _StepCosts, plan: list[int]):
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


def _position_options(rates: list[float]) -> list[StepOption]:
    """Lookup options k = 1..len(rates) from each token's chance of acceptance given the ones before it:
    token j is emitted as a draft if all of 0..j are accepted."""
    out, reach, tokens = [], 1.0, 1.0
    for a in rates:
        reach *= max(0.0, min(1.0, a))
        tokens += reach
        out.append(StepOption(True, len(out) + 1, tokens))
    return out


def _pays_in_batch(opts: list[StepOption], size: int, sc: _StepCosts, plain: StepOption = PLAIN) -> bool:
    """Whether one of ``opts`` beats ``plain`` for a request in a batch of ``size`` plain requests."""
    return _Batch([[PLAIN]] * (size - 1) + [[plain] + opts], sc, [0] * size).best_for(size - 1) != 0


def _draft_index(opts: list[StepOption], depth: int, default: int) -> int:
    """The index of the deepest draft-model option of at most ``depth`` tokens, else ``default``."""
    best = default
    for j, o in enumerate(opts):
        if o.draft_steps and o.k <= depth and (not opts[best].draft_steps or o.k > opts[best].k):
            best = j
    return best


def _best_alone(opts: list[StepOption], sc: _StepCosts) -> int:
    return _Batch([opts], sc, [0]).best_for(0)


def _ascend(options: list[list[StepOption]], sc: _StepCosts, plan: list[int], sweeps: int = 3):
    b = _Batch(options, sc, plan)
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


_CALIBRATED: dict[str, "CostModel"] = {}  # this process's calibrations by calibration_key


class AdaptiveK:
    """A proposer's adaptive-k policy: each request's k per draft kind (looked up in the context, or from a
    draft model), and what each verification teaches it. With ``enabled`` off, k is always the cap and the
    counts are still kept (they cost nothing and say how each kind fares)."""

    def __init__(self, enabled: bool = False, costs: CostModel | None = None):
        self.enabled = enabled
        self.costs = costs if costs is not None else CostModel()
        self._lengths: list[int] = []  # output lengths of the last finished requests, oldest first
        self._capped: list[bool] = []  # whether each of them was cut by its budget (so it would have run longer)
        self._points: tuple[list[float], list[float]] | None = None  # see _length_points; None: to rebuild
        self._peak = 0.0  # recent batch sizes, decayed: what a batch that shrank for a moment grows back to
        self.expected_batch = 0  # requests the engine holds now (Proposer.expect_batch)
        self.confidence = ConfidenceRates()
        self.drafting_hopeless = False  # the last plan's finding (see plan): confidences need not be noted

    def calibrate(self, target, draft, k_max: int, max_len: int, identity: dict[str, Any],
                  refresh: bool = False) -> CostModel:
        """Pass costs for this policy (see ``calibrate``), kept per model files, weight formats, CPU, kernel
        path and threads (``identity`` plus the files of its "target" and "draft" paths) in the cache folder,
        so that only the first engine start with a given setup times passes. ``refresh``: time them again."""
        import copy

        from specdecode.models.default_models import cache_dir, notice

        k_max = max(1, min(k_max, max_len - 2))
        batch = _batch_size(target)
        parts = dict(identity, target=_file_identity(identity.get("target")),
                     draft=_file_identity(identity.get("draft")) if draft is not None else None,
                     rows=calibration_rows(k_max, batch), max_len=max_len,
                     draft_rows=draft_calibration_rows(batch) if draft is not None else None)
        key = calibration_key(parts)
        if refresh or key not in _CALIBRATED:
            t0 = time.perf_counter()

            def run() -> CostModel:
                notice("Timing speculative decoding's pass costs for this setup (once; kept for later starts)")
                return calibrate(target, draft, k_max, max_len, batch=batch)

            files = [f for part in ("target", "draft") for f, *_ in parts[part] or ()]
            costs, hit = cached_calibration(key, run, cache_dir(), refresh, files)
            if not hit:
                logger.info("Calibrated adaptive speculation costs in %.1f s (kept for later starts)",
                            time.perf_counter() - t0)
            _CALIBRATED[key] = costs
        self.costs = copy.deepcopy(_CALIBRATED[key])
        return self.costs

    def plan(self, requests: list, budgets: list[int], lookup_ks: list[int], draft_ks: list[int],
             lookup_rates: list[list[float] | None] | None = None) -> list[tuple[bool, int]]:
        """Per request, (looked_up, k) for this step: request i may look up at most lookup_ks[i] tokens (what
        its lookup found) or draft at most draft_ks[i] with the draft model; ``budgets`` are the engine's (what
        each may still emit). ``lookup_rates[i]``, where the lookup source knows them: each looked-up token's
        chance of acceptance (the tokens before it accepted), instead of the request's average lookup rates.
        Without adaptive k: a lookup found is a lookup used, else the draft model's cap.

        With it, plan_step weighs every request's options together (the step's whole target pass and the
        batch's draft passes), then each request that ends up at k = 0 for a kind it could use keeps that
        kind's probing: a request in a run drafts one more token, and one at k = 0 is probed with k = 1 now and
        then, waiting twice as long after each probe that did not bring speculation back (see next_k). Both
        only where acceptance is what keeps it off: where even well-accepted drafts would not pay for their
        rows at this batch's costs, a probe could teach nothing worth its price."""
        if not self.enabled:
            return [(True, lk) if lk else (False, dk) for lk, dk in zip(lookup_ks, draft_ks)]
        n = len(requests)
        if not n:
            return []
        context = sum(len(r.all_token_ids) for r in requests) // n
        sc = _StepCosts(self.costs, context)
        self._peak = max(float(n), self._peak * _PEAK_DECAY)
        peak = max(int(self._peak + 0.5), self.expected_batch)
        # Where the draft model cannot pay at this batch even if it drafted well, its options are left out: they
        # would lose every comparison, and weighing them and noting the confidences that judge them (note_target)
        # cost the step more than it gains.
        self.drafting_hopeless = not self._drafting_could_pay(requests, draft_ks, sc)
        if self.drafting_hopeless:
            draft_ks = [0] * n
        options, starts = [], []
        for i, (r, budget, lk, dk) in enumerate(zip(requests, budgets, lookup_ks, draft_ks)):
            plain, drafts = _plain(r), self._options(r, False, dk, budget, sc)
            if drafts and peak > n and drafts[0].once and not _pays_in_batch(drafts, peak, sc, plain):
                # The draft model would have to catch up first, and that one-off only pays back over many
                # steps; if the batch is about to grow back to where drafting no longer pays (requests
                # still being prefilled, or a pause between requests), those steps never come.
                drafts = []
            positions = lookup_rates[i] if lookup_rates is not None else None
            looked_up = (_after(_position_options(positions[:lk]), prefix_length(r)) if positions and lk
                         else self._options(r, True, lk, budget, sc))
            opts = [plain] + looked_up + drafts
            options.append(opts)
            last = getattr(r, "spec_plan", None)
            starts.append(next((j for j, o in enumerate(opts) if last == (o.lookup, o.k)), 0))
        chosen = plan_step(options, self.costs, context, starts)
        batch = _Batch(options, sc, chosen)
        out = []
        for i, (r, budget, lk, dk) in enumerate(zip(requests, budgets, lookup_ks, draft_ks)):
            o = options[i][chosen[i]]
            pick = (o.lookup, o.k)
            # A lookup won this step, but starting the draft model would have paid too: it catches up now, or
            # its catch-up would grow with every token while the tokens left to repay it shrink, and a request
            # that looked something up at its first step would never start it.
            r.draft_warm_up = False
            if o.lookup and o.k:
                drafts = [x for x in options[i] if x.draft_steps]
                r.draft_warm_up = bool(drafts and drafts[0].once and batch.best_for(i, opts=options[i][:1] + drafts))
            if o.k:
                acc = r.lookup_acceptance if o.lookup else r.acceptance
                acc.steps_without_spec, acc.probe_every = 0, PROBE_EVERY
            else:
                pick = self._probe(r, i, batch, budget, sc, lk, dk)
            r.spec_plan = pick
            out.append(pick)
        return out

    def _drafting_could_pay(self, requests: list, draft_ks: list[int], sc: _StepCosts) -> bool:
        """Whether the draft model could raise this step's rate at any depth up to the requests' caps, drafting for
        one request or for all of them (the others plain), at a hopeful acceptance: the highest of OPTIMISTIC_RATE,
        the engine-wide rates, the own rates of the requests that have drafted, and (for one that has not, whose
        prior its confidences give) the best rate any confidence band gives. Catch-ups are left out, so this errs
        towards yes."""
        cap = max(draft_ks, default=0)
        if cap <= 0:
            return False
        n = len(requests)
        prior = self.costs.prior_of(False)
        hope = max(OPTIMISTIC_RATE, *prior.kind_rates())
        by_confidence = False
        for r, dk in zip(requests, draft_ks):
            if not dk:
                continue
            if r.acceptance.first_n + r.acceptance.next_n > 0:
                hope = max(hope, *r.acceptance.rates(prior))
            else:  # its prior comes from its confidences where it has them (prior_of)
                by_confidence = by_confidence or getattr(r, "confidence", None) is not None
        if by_confidence:
            hope = max(hope, self.confidence.best_rate())
        one_row = sc.verify(n)
        plain = n / one_row if one_row > 0 else float("inf")
        for m in sorted({1, n}):
            for k in range(1, cap + 1):
                seconds = sc.verify(n + m * k) + k * sc.draft(m)
                if seconds <= 0 or (n + m * (expected_tokens(hope, hope, k) - 1)) / seconds > plain:
                    return True
        return False

    def _options(self, r, lookup: bool, cap: int, budget: int, sc: _StepCosts,
                 rates: tuple[float, float] | None = None, spread: bool = True) -> list[StepOption]:
        """r's options of one kind, k = 1..cap, with their expected tokens (from ``rates``, by default r's own
        acceptance of that kind) and, for the draft model, the one-off catch-up it owes this step: spread over
        the tokens the request is all but sure to have left (``assured_left``), or (``spread`` off) charged to
        this step in full."""
        if cap <= 0:
            return []
        p1, q = rates if rates is not None else (
            (r.lookup_acceptance if lookup else r.acceptance).rates(self.prior_of(r, lookup)))
        lag = 0
        if not lookup:
            done = getattr(r, "draft_computed", 0)
            context = len(r.all_token_ids) + prefix_length(r)
            lag = context - done if done else context
        # The draft model's first pass feeds what it has not seen yet: one token after a step it drafted in,
        # the whole context the first time (its prefill) or after sitting out. That extra work buys drafts for
        # the rest of the request, so it is spread over the tokens the request is all but sure to have left.
        extra = max(0.0, sc.draft(lag) - sc.draft(1)) if lag > 1 else 0.0
        if extra and spread:
            extra /= self.assured_left(r, budget) * _free_share(r)
        out = []
        for k in range(1, cap + 1):
            e = expected_tokens(p1, q, k)
            out.append(StepOption(lookup, k, e, extra * (e if spread else 1.0)))
        return _after(out, prefix_length(r))

    def _probe(self, r, i: int, batch: "_Batch", budget: int, sc: _StepCosts, lk: int, dk: int
               ) -> tuple[bool, int]:
        """The plan left r at k = 0: k = 1 of a kind it could use if that kind is in a run or due for a probe,
        where well-accepted drafts of that kind would pay (see plan); else plain."""
        for lookup, cap in ((True, lk), (False, dk)):
            if not cap:
                continue
            acc = r.lookup_acceptance if lookup else r.acceptance
            hope = max(OPTIMISTIC_RATE, *acc.rates(self.prior_of(r, lookup)))
            # A probe is one step, not a commitment: a draft model that sat out must first catch up on every
            # token it missed, and that is only worth it if even this single step pays for it.
            if not batch.best_for(i, opts=[_plain(r)] + self._options(r, lookup, cap, budget, sc, (hope, hope),
                                                                   spread=False)):
                continue  # its rows (or catch-up) cost too much at this batch: no acceptance would pay for them
            if acc.in_run:
                return lookup, 1  # see next_k: a run's own rate must stay observed
            acc.steps_without_spec += 1
            if acc.steps_without_spec >= acc.probe_every:
                acc.steps_without_spec = 0
                acc.probe_every = min(2 * acc.probe_every, MAX_PROBE_EVERY)
                return lookup, 1
        return False, 0

    def note_confidence(self, r, confidence: float | None) -> None:
        """The target's confidence at r's step's first position (``Proposer.note_target``); r keeps its latest."""
        if confidence is not None:
            r.confidence.append(confidence)
            del r.confidence[:-_CONFIDENCE_WINDOW]

    def prior_of(self, r, lookup: bool):
        """What r's own counts of a draft kind are smoothed toward: the engine-wide counts; for a draft model
        that has not drafted for r yet, what the target's confidence over r's latest positions predicts
        (``ConfidenceRates``), where the engine notes it. Once r has its own counts, the engine-wide ones
        smooth them as before."""
        confidences = getattr(r, "confidence", None)
        if lookup or not confidences or r.acceptance.first_n + r.acceptance.next_n > 0:
            return self.costs.prior_of(lookup)
        return self.confidence.prior(confidences, self.costs.prior)

    def assured_left(self, r, budget: int) -> float:
        """Tokens r goes on to emit with probability _ASSURED, judging by the finished requests that ran at
        least as long as r has so far (and capped by r's budget): what a draft catch-up is spread over. A
        quantile, not the mean: answers come short or long, and the mean of such a mix says that a short
        answer is about to run long, so its catch-up would never be paid back. This way the draft model starts
        at once where answers run long, and where some are short, only after r has clearly outlived them
        (each answer that ended by itself stands for answers up to twice as long, _LEN_SPREAD). A request
        that outlives every one seen is taken to have _MIN_LEFT to go."""
        done = getattr(r, "num_output_tokens", 0)
        lengths, cum = self._length_points()
        lo = bisect.bisect_right(lengths, done)  # the points r has not outlived
        if lo == len(lengths):
            return max(1.0, min(budget + 1, _MIN_LEFT))
        # What is left grows with the length, so the points from lo on are already in order of it: the quantile
        # is the first point by which (1 - _ASSURED) of their weight is reached.
        need = cum[lo] + (1.0 - _ASSURED) * (cum[-1] - cum[lo])
        j = min(bisect.bisect_left(cum, need, lo + 1), len(lengths)) - 1
        return max(1.0, min(lengths[j] - done, budget + 1))

    def _length_points(self) -> tuple[list[float], list[float]]:
        """The finished requests' lengths as weighted points, sorted by length, with their cumulative weights
        (cum[i]: the weight of the points before i). Decayed weights: the newest finished request weighs 1,
        each one before it _PRIOR_DECAY times less, and the guess made before any had finished fades the
        same way; an answer that ended by itself is spread over _LEN_SPREAD. Built once per finished request,
        not at every step that asks assured_left."""
        if self._points is None:
            n = len(self._lengths)
            seen = [(_LEN_PRIOR, _LEN_PRIOR_WEIGHT * _PRIOR_DECAY ** n)]
            for i, (length, capped) in enumerate(zip(self._lengths, self._capped)):
                w = _PRIOR_DECAY ** (n - 1 - i)
                spread = (1.0,) if capped else _LEN_SPREAD
                seen += [(length * f, w / len(spread)) for f in spread]
            seen.sort()
            self._points = [length for length, _ in seen], list(itertools.accumulate((w for _, w in seen),
                                                                                     initial=0.0))
        return self._points

    def finished(self, r) -> None:
        """r is done: its length teaches how long requests run (for spreading one-off draft work). Once per
        request, however many proposers (a hybrid and its parts) report it."""
        if getattr(r, "spec_finished", False):
            return
        r.spec_finished = True
        keep = _LEN_WINDOW - 1
        self._lengths = self._lengths[-keep:] + [getattr(r, "num_output_tokens", 0)]
        self._capped = self._capped[-keep:] + [getattr(r, "finish_reason", None) == "length"]
        self._points = None
        r.spec_plan = None

    def lookup_depth(self, r, cap: int) -> int:
        """How deep a lookup may draft for r without touching its probing state: the cap, or the best k for
        the lookups' own acceptance (0 while they do not pay)."""
        if not self.enabled:
            return cap
        return choose_k(*r.lookup_acceptance.rates(self.costs.lookup_prior), cap, self.costs, True,
                        len(r.all_token_ids))

    def learn(self, r, drafted: list[int], accepted: int, looked_up: bool, found: list[int],
              emitted: list[int], copied_from: int | None) -> None:
        """Teach the counts what this step showed about each draft kind of r. ``found``: a lookup that was
        available but not used; ``copied_from``: where a copy opened by draft-model tokens begins."""
        costs = self.costs
        confidences = getattr(r, "confidence", None)
        if confidences and drafted and not looked_up and copied_from != 0:
            # the step's first row is the draft model's first token (the engine noted its confidence last)
            self.confidence.observe(confidences[-1], accepted >= 1, r.acceptance.in_run)
        if copied_from is not None:
            # The draft model's tokens, then a copy they opened: each part counts for its own kind; the copy
            # was only tried if every draft-model token before it was accepted.
            costs.observe_acceptance(r.acceptance, copied_from, min(accepted, copied_from))
            if accepted >= copied_from:
                costs.observe_acceptance(r.lookup_acceptance, len(drafted) - copied_from,
                                         accepted - copied_from, lookup=True)
            else:
                r.lookup_acceptance.observe(0, 0)
            return
        used, other = (r.lookup_acceptance, r.acceptance) if looked_up else (r.acceptance, r.lookup_acceptance)
        costs.observe_acceptance(used, len(drafted), accepted, lookup=looked_up)
        if looked_up or not drafted:
            costs.prior.fade(_IDLE_KEEP)  # the draft model sat out this step (see _IDLE_KEEP)
        if found and not looked_up:
            # An unused lookup is scored against the tokens the target emitted. For a one-hot draft that is
            # exactly the acceptance test (greedy: the same argmax; sampled: accepted with probability p(token),
            # the chance the sample equals it), cut at the emitted length, beyond which nothing is known.
            n = min(len(found), len(emitted))
            match = next((j for j in range(n) if found[j] != emitted[j]), n)
            costs.observe_acceptance(other, n, match, lookup=True)
        else:
            other.observe(0, 0)  # this kind did not draft: a step without drafts ends its run


# ---- calibrated costs, cached on disk ----
# A calibration times passes for a few seconds; its result only depends on the models' files, the weight
# formats, the CPU and kernel path and the thread count, so it is kept per such key and reused by every later
# engine start. Bump the version when what calibrate() measures changes.
_COSTS_VERSION = 4  # 2: batch row counts, and draft passes over several rows; 3-4: load checked
_COSTS_FILE = "adaptive_costs.json"
_MAX_CACHED_COSTS = 64


def _batch_size(runner) -> int:
    """How many requests the runner's cache holds at once (the largest batch a step can have)."""
    kv = getattr(runner, "kv_cache", None)
    for name in ("num_slots", "max_num_seqs"):
        n = getattr(kv, name, None) or getattr(runner, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return 1


def _file_identity(path: str | os.PathLike | None) -> list:
    """Name, size and modification time of a model's files (a directory: its weight and config files)."""
    if path is None:
        return []
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.glob("*") if f.suffix in
                                           (".gguf", ".safetensors", ".bin", ".json", ".pt"))
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_key(parts: dict[str, Any]) -> str:
    """A stable digest of what a calibration depends on (``parts``), plus the CPU and the cache version."""
    full = dict(parts, cpu=_cpu_name(), machine=platform.machine(), version=_COSTS_VERSION)
    return hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:32]


def model_identity(path) -> list:
    """What identifies a model for the cost cache: its files' names, sizes and modification times."""
    return _file_identity(path)


def _costs_to_json(c: CostModel) -> dict:
    return {"verify": {str(ctx): {str(r): s for r, s in t.items()} for ctx, t in c.verify.items()},
            "draft": {str(ctx): s for ctx, s in c.draft.items()},
            "draft_rows": {str(ctx): {str(r): s for r, s in t.items()} for ctx, t in c.draft_rows.items()}}


def _costs_from_json(d: dict) -> CostModel:
    c = CostModel()
    for ctx, table in d["verify"].items():
        for rows, s in table.items():
            if not (isinstance(s, (int, float)) and s > 0):
                raise ValueError("bad cost entry")
            c.add(int(ctx), int(rows), float(s))
    for ctx, s in d["draft"].items():
        if not (isinstance(s, (int, float)) and s > 0):
            raise ValueError("bad cost entry")
        c.add_draft(int(ctx), float(s))
    for ctx, table in d.get("draft_rows", {}).items():
        for rows, s in table.items():
            if not (isinstance(s, (int, float)) and s > 0):
                raise ValueError("bad cost entry")
            c.add_draft(int(ctx), float(s), int(rows))
    if not c.verify:
        raise ValueError("empty cost entry")
    return c


def cached_calibration(key: str, run: Callable[[], CostModel], directory: Path | None,
                       refresh: bool = False, files: list[str] | None = None) -> tuple[CostModel, bool]:
    """The calibration stored under ``key`` in ``directory`` (see calibration_key), else ``run()``'s result,
    stored for the next engine start unless other processes kept the CPUs busy while it ran (see
    MAX_OTHER_CPU_SHARE; ``refresh``: always run, and replace what is stored). Returns (costs,
    whether they came from the cache). ``files``: the model files the costs are for; once one of them is gone
    the entry is dropped first when the cache is full. A missing, corrupt or unwritable cache only costs the
    calibration: it is never an error."""
    path = directory / _COSTS_FILE if directory is not None else None
    entries: dict = {}
    if path is not None and path.is_file():
        try:
            entries = json.loads(path.read_text())
            if not isinstance(entries, dict):
                entries = {}
            if key in entries and not refresh:
                return _costs_from_json(entries[key]), True
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("Ignoring the unreadable speculation cost cache %s (%s); recalibrating.", path, e)
            entries = entries if isinstance(entries, dict) else {}
            entries.pop(key, None)
    costs = run()
    if path is None:
        return costs, False
    share = costs.other_cpu_share
    if share is not None and share > MAX_OTHER_CPU_SHARE:
        logger.warning("Other processes used %.0f%% of this process's CPUs while speculation costs were timed: "
                       "the costs are used for this run but not kept, and a later start calibrates again.",
                       100 * share)
        return costs, False
    entries[key] = dict(_costs_to_json(costs), saved=time.time(), files=list(files or ()))
    if len(entries) > _MAX_CACHED_COSTS:
        # Entries for models whose files are gone (a test's temporary model, say) go first, then the oldest.
        def worth(k: str) -> tuple[bool, float]:
            e = entries[k] if isinstance(entries[k], dict) else {}
            files = e.get("files") if isinstance(e.get("files"), list) else []
            return all(isinstance(f, str) and os.path.exists(f) for f in files), e.get("saved", 0)
        for k in sorted(entries, key=worth)[:len(entries) - _MAX_CACHED_COSTS]:
            entries.pop(k)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("Could not store the speculation costs in %s (%s); the next start calibrates again.",
                       path, e)
    return costs, False
