"""``AdaptiveK``: a proposer's adaptive-k policy, and what it keeps about each request (``Request.spec``).

Each step it plans every request's option (planner.py) from the request's acceptance of each draft kind
(acceptance.py) and the calibrated pass costs (costs.py), and each verification teaches it. Drafts looked up in
the prompt (n-gram) and drafts from a draft model succeed at very different rates in the same text, so each kind
has its own counts, its own probing and its own engine-wide prior: with ``ngram_first`` a request may look up
deep while its draft model is off, or the other way round.

The draft model's first pass for a request feeds every token it has not seen (its prompt, the first time): that
one-off cost is spread over the tokens the request is all but sure to have left (its budget, and the lengths of
finished requests that ran as long as it has), so a short answer never pays for a draft prefill it cannot earn
back: where some answers are short, the draft model starts once a request has outlived them. Before any
answer has ended it starts once the request's decoding has cost a few times the catch-up (``_RENT``).
"""
from __future__ import annotations

import bisect
import copy
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

from specdecode.speculative.adaptive.acceptance import (CONFIDENCE_WINDOW, MAX_PROBE_EVERY, PRIOR_DECAY, PROBE_EVERY,
                                                        ConfidenceRates)
from specdecode.speculative.adaptive.cache import cached_calibration, calibration_key, file_identity
from specdecode.speculative.adaptive.calibration import (CONTEXTS, VERSION, batch_size, calibrate, calibration_rows,
                                                         draft_calibration_rows)
from specdecode.speculative.adaptive.costs import CostModel, expected_tokens
from specdecode.speculative.adaptive.planner import (PLAIN, BatchPlan, StepCosts, StepOption, after_forced, choose_k,
                                                     pays_in_batch, plan_step, position_options)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("specdecode")

OPTIMISTIC_RATE = 0.9  # acceptance that would make drafting pay, for "is it the acceptance that says no?"
# Per request step in which the draft model did not draft: how much of the engine-wide draft-model counts is
# kept. A draft model that sat out must first catch up on a request's whole context, which a low engine-wide
# rate never pays for, so without this one bad stretch of requests would switch it off for good (nothing new
# would be observed). This way the counts fade to the neutral guess over a few hundred such steps (a few long
# answers, many more short ones) and a later request tries the draft model again.
_IDLE_KEEP = 0.99
_LEN_PRIOR, _LEN_PRIOR_WEIGHT = 128.0, 2.0  # output tokens a request is taken to run before any has finished
_MIN_LEFT = 16.0
_LEN_WINDOW = 128      # finished requests whose lengths are kept (older ones weigh < 0.1 by then)
_ASSURED = 0.9         # a one-off draft catch-up must pay back within what this share of requests runs on
# A finished answer of L tokens that ended by itself stands for answers of L .. 2L (log-uniform, as points): a
# request that has just outlived the short answers seen so far is still likely to be one of them, while one that
# has not reached L yet is not taken to end any sooner than L.
_LEN_SPREAD = tuple(2.0 ** (j / 4) for j in range(5))
# A draft catch-up is paid only once the request's own decoding has cost _RENT times as much (ski rental):
# before any answer has ended, nothing says how long this one runs, and a catch-up paid just before a short
# answer ends is pure loss (a 190-token prompt's catch-up is about 0.3 s, a 14-token answer about 0.7 s).
# Lookups are free and stay on meanwhile; a long answer forgoes the draft model's gain on its first few tokens.
_RENT = 3.0
_PEAK_DECAY = 0.98     # per step: how fast the remembered batch size falls back after the batch shrinks
_CALIBRATED: dict[str, CostModel] = {}  # this process's calibrations by calibration_key


def prefix_length(r) -> int:
    """How many tokens the engine drafts for r this step ahead of the proposer's (``draft_prefix``, the text
    its grammar forces; see proposer.context_of). Every option of r verifies them, and they are counted as
    emitted: the grammar allows nothing else."""
    return len(r.draft_prefix)


def _free_share(r) -> float:
    """The share of r's output that its grammar does not force (1 without a grammar), judged by its output so
    far and this step's forced text: only those tokens are drafted by the proposer, so only they repay a
    draft model's catch-up."""
    forced = r.num_forced + prefix_length(r)
    if not forced:
        return 1.0
    return max(0.05, 1.0 - forced / max(1, r.num_output_tokens + prefix_length(r)))


def _plain(r) -> StepOption:
    """r's plain option: no drafts of the proposer's (forced text is still verified)."""
    return after_forced([PLAIN], prefix_length(r))[0]


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
        # A draft model with a bounded context (draft_model.DraftModelProposer's window): the most tokens its
        # view of a request holds, and the longest catch-up it feeds (a rebuilt view); 0: unbounded.
        self.draft_context = 0
        self.draft_catch_up = 0

    def calibrate(self, target, draft, k_max: int, max_len: int, identity: dict[str, Any],
                  refresh: bool = False, draft_head: torch.nn.Module | None = None) -> CostModel:
        """Pass costs for this policy (see ``calibration.calibrate``; ``draft_head``: the LM head the draft's
        passes are timed with), kept per model files, weight formats, CPU, kernel path and threads
        (``identity`` plus the files of its "target" and "draft" paths) in the cache folder, so that only the
        first engine start with a given setup times passes. ``refresh``: time them again."""
        from specdecode.models.default_models import cache_dir, notice

        k_max = max(1, min(k_max, max_len - 2))
        batch = batch_size(target)
        parts = dict(identity, target=file_identity(identity.get("target")),
                     draft=file_identity(identity.get("draft")) if draft is not None else None,
                     rows=calibration_rows(k_max, batch), max_len=max_len, contexts=CONTEXTS, how=VERSION,
                     draft_rows=draft_calibration_rows(batch) if draft is not None else None)
        key = calibration_key(parts)
        if refresh or key not in _CALIBRATED:
            t0 = time.perf_counter()

            def run() -> CostModel:
                notice("Timing speculative decoding's pass costs for this setup (once; kept for later starts)")
                return calibrate(target, draft, k_max, max_len, batch=batch, draft_head=draft_head)

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
        sc = StepCosts(self.costs, context, self.draft_context)
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
            if drafts and peak > n and drafts[0].once and not pays_in_batch(drafts, peak, sc, plain):
                # The draft model would have to catch up first, and that one-off only pays back over many
                # steps; if the batch is about to grow back to where drafting no longer pays (requests
                # still being prefilled, or a pause between requests), those steps never come.
                drafts = []
            positions = lookup_rates[i] if lookup_rates is not None else None
            looked_up = (after_forced(position_options(positions[:lk]), prefix_length(r)) if positions and lk
                         else self._options(r, True, lk, budget, sc))
            opts = [plain] + looked_up + drafts
            options.append(opts)
            last = r.spec.plan
            starts.append(next((j for j, o in enumerate(opts) if last == (o.lookup, o.k)), 0))
        chosen = plan_step(options, self.costs, context, starts, self.draft_context)
        batch = BatchPlan(options, sc, chosen)
        out = []
        for i, (r, budget, lk, dk) in enumerate(zip(requests, budgets, lookup_ks, draft_ks)):
            o = options[i][chosen[i]]
            pick = (o.lookup, o.k)
            # A lookup won this step, but starting the draft model would have paid too: it catches up now, or
            # its catch-up would grow with every token while the tokens left to repay it shrink, and a request
            # that looked something up at its first step would never start it.
            r.spec.draft_warm_up = False
            if o.lookup and o.k:
                drafts = [x for x in options[i] if x.draft_steps]
                r.spec.draft_warm_up = bool(drafts and drafts[0].once
                                            and batch.best_for(i, opts=options[i][:1] + drafts))
            if o.k:
                acc = r.spec.lookup_acceptance if o.lookup else r.spec.acceptance
                acc.steps_without_spec, acc.probe_every = 0, PROBE_EVERY
            else:
                pick = self._probe(r, i, batch, budget, sc, lk, dk)
            r.spec.plan = pick
            out.append(pick)
        return out

    def _drafting_could_pay(self, requests: list, draft_ks: list[int], sc: StepCosts) -> bool:
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
            if r.spec.acceptance.first_n + r.spec.acceptance.next_n > 0:
                hope = max(hope, *r.spec.acceptance.rates(prior))
            else:  # its prior may come from its confidences (prior_of)
                by_confidence = True
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

    def _options(self, r, lookup: bool, cap: int, budget: int, sc: StepCosts,
                 rates: tuple[float, float] | None = None, spread: bool = True) -> list[StepOption]:
        """r's options of one kind, k = 1..cap, with their expected tokens (from ``rates``, by default r's own
        acceptance of that kind) and, for the draft model, the one-off catch-up it owes this step: spread over
        the tokens the request is all but sure to have left (``assured_left``), or (``spread`` off) charged to
        this step in full."""
        if cap <= 0:
            return []
        p1, q = rates if rates is not None else (
            (r.spec.lookup_acceptance if lookup else r.spec.acceptance).rates(self.prior_of(r, lookup)))
        lag = 0
        if not lookup:
            done = r.draft_computed
            context = len(r.all_token_ids) + prefix_length(r)
            lag = context - done if done else context
            if self.draft_catch_up:
                lag = min(lag, self.draft_catch_up)
        # The draft model's first pass feeds what it has not seen yet: one token after a step it drafted in,
        # the whole context the first time (its prefill) or after sitting out. That extra work buys drafts for
        # the rest of the request, so it is spread over the tokens the request is all but sure to have left.
        extra = max(0.0, sc.draft(lag) - sc.draft(1)) if lag > 1 else 0.0
        if extra and spread:
            if extra * _RENT > r.num_output_tokens * sc.verify(1):
                return []  # not before the request has run long enough (see _RENT)
            extra /= self.assured_left(r, budget) * _free_share(r)
        out = []
        for k in range(1, cap + 1):
            e = expected_tokens(p1, q, k)
            out.append(StepOption(lookup, k, e, extra * (e if spread else 1.0)))
        return after_forced(out, prefix_length(r))

    def _probe(self, r, i: int, batch: "BatchPlan", budget: int, sc: StepCosts, lk: int, dk: int
               ) -> tuple[bool, int]:
        """The plan left r at k = 0: k = 1 of a kind it could use if that kind is in a run or due for a probe,
        where well-accepted drafts of that kind would pay (see plan); else plain."""
        for lookup, cap in ((True, lk), (False, dk)):
            if not cap:
                continue
            acc = r.spec.lookup_acceptance if lookup else r.spec.acceptance
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
            r.spec.confidence.append(confidence)
            del r.spec.confidence[:-CONFIDENCE_WINDOW]

    def prior_of(self, r, lookup: bool):
        """What r's own counts of a draft kind are smoothed toward: the engine-wide counts; for a draft model
        that has not drafted for r yet, what the target's confidence over r's latest positions predicts
        (``ConfidenceRates``), where the engine notes it. Once r has its own counts, the engine-wide ones
        smooth them as before."""
        confidences = r.spec.confidence
        if lookup or not confidences or r.spec.acceptance.first_n + r.spec.acceptance.next_n > 0:
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
        done = r.num_output_tokens
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
        each one before it PRIOR_DECAY times less, and the guess made before any had finished fades the
        same way; an answer that ended by itself is spread over _LEN_SPREAD. Built once per finished request,
        not at every step that asks assured_left."""
        if self._points is None:
            n = len(self._lengths)
            seen = [(_LEN_PRIOR, _LEN_PRIOR_WEIGHT * PRIOR_DECAY ** n)]
            for i, (length, capped) in enumerate(zip(self._lengths, self._capped)):
                w = PRIOR_DECAY ** (n - 1 - i)
                spread = (1.0,) if capped else _LEN_SPREAD
                seen += [(length * f, w / len(spread)) for f in spread]
            seen.sort()
            self._points = [length for length, _ in seen], list(itertools.accumulate((w for _, w in seen),
                                                                                     initial=0.0))
        return self._points

    def finished(self, r) -> None:
        """r is done: its length teaches how long requests run (for spreading one-off draft work). Once per
        request, however many proposers (a hybrid and its parts) report it."""
        if r.spec.finished:
            return
        r.spec.finished = True
        keep = _LEN_WINDOW - 1
        self._lengths = self._lengths[-keep:] + [r.num_output_tokens]
        self._capped = self._capped[-keep:] + [r.finish_reason == "length"]
        self._points = None
        r.spec.plan = None

    def lookup_depth(self, r, cap: int) -> int:
        """How deep a lookup may draft for r without touching its probing state: the cap, or the best k for
        the lookups' own acceptance (0 while they do not pay)."""
        if not self.enabled:
            return cap
        return choose_k(*r.spec.lookup_acceptance.rates(self.costs.lookup_prior), cap, self.costs, True,
                        len(r.all_token_ids))

    def learn(self, r, drafted: list[int], accepted: int, looked_up: bool, found: list[int],
              emitted: list[int], copied_from: int | None) -> None:
        """Teach the counts what this step showed about each draft kind of r. ``found``: a lookup that was
        available but not used; ``copied_from``: where a copy opened by draft-model tokens begins."""
        costs = self.costs
        confidences = r.spec.confidence
        if confidences and drafted and not looked_up and copied_from != 0:
            # the step's first row is the draft model's first token (the engine noted its confidence last)
            self.confidence.observe(confidences[-1], accepted >= 1, r.spec.acceptance.in_run)
        if copied_from is not None:
            # The draft model's tokens, then a copy they opened: each part counts for its own kind; the copy
            # was only tried if every draft-model token before it was accepted.
            costs.observe_acceptance(r.spec.acceptance, copied_from, min(accepted, copied_from))
            if accepted >= copied_from:
                costs.observe_acceptance(r.spec.lookup_acceptance, len(drafted) - copied_from,
                                         accepted - copied_from, lookup=True)
            else:
                r.spec.lookup_acceptance.observe(0, 0)
            return
        spec = r.spec
        used, other = ((spec.lookup_acceptance, spec.acceptance) if looked_up
                       else (spec.acceptance, spec.lookup_acceptance))
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

