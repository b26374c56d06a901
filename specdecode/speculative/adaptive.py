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
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("specdecode")

_REQUEST_DECAY = 0.8   # per verification: a request's counts follow its text as it changes
_PRIOR_DECAY = 0.98    # the engine-wide counts new requests start from
_PRIOR_WEIGHT = 2.0    # pseudo-trials of the engine-wide rate in a request's estimate
_NEUTRAL_WEIGHT = 1.0  # pseudo-trials at 0.7 in the engine-wide estimate
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

    def rates(self, prior: "Acceptance | None" = None) -> tuple[float, float]:
        """(p1, q): the acceptance chance of this step's first draft token, and of each one after it."""
        first, nxt = self.kind_rates(prior)
        return (nxt if self.in_run else first), nxt


def _prior() -> Acceptance:
    return Acceptance(decay=_PRIOR_DECAY)  # the neutral pseudo-trial stands in until verifications come in


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
    prior: Acceptance = field(default_factory=_prior)         # draft-model acceptance over all requests
    lookup_prior: Acceptance = field(default_factory=_prior)  # the same for drafts looked up in the context

    def add(self, context: int, rows: int, seconds: float) -> None:
        self.verify.setdefault(context, {})[rows] = seconds

    def add_draft(self, context: int, seconds: float) -> None:
        self.draft[context] = seconds

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
        return _across_contexts({c: _rows_cost(t, rows) for c, t in self.verify.items()}, context)

    def draft_cost(self, context: int = 0) -> float | None:
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


def calibration_rows(k_max: int) -> list[int]:
    """Row counts timed by ``calibrate``: 1-3, then doubling, and k_max + 1 (the rest is interpolated)."""
    rows, r = {1, 2, 3, k_max + 1}, 3
    while r < k_max + 1:
        r = 2 * r - 1
        rows.add(min(r, k_max + 1))
    return sorted(x for x in rows if x <= k_max + 1)


def calibrate(target, draft, k_max: int, max_len: int, repeats: int = 5,
              contexts: tuple[int, ...] = (32, 512)) -> CostModel:
    """Time target passes over 1..k_max+1 rows (see calibration_rows) and, with a draft runner, one draft
    step, after each of a short and a long context, on cache slot 0 (call it while no request runs: the
    slot's content is left as scratch). Each round times every row count and the draft step back to back,
    after one untimed warm-up round."""
    import torch

    k_max = max(1, min(k_max, max_len - 2))  # a context of at least 1 plus k_max + 1 rows must fit
    sizes = calibration_rows(k_max)
    costs = CostModel()
    gen = torch.Generator().manual_seed(0)
    vocab = min(target.vocab_size, draft.vocab_size if draft is not None else target.vocab_size)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    for ctx in sorted({max(1, min(c, max_len - k_max - 2)) for c in contexts}):
        ids = torch.randint(0, vocab, (ctx + k_max + 1,), generator=gen).tolist()
        with torch.inference_mode():
            target.prefill(0, ids[:ctx])
            if draft is not None:
                draft.prefill(0, ids[:ctx])
            times: dict[int, list[float]] = {n: [] for n in sizes + [0]}  # 0: the draft step
            for rnd in range(repeats + 1):
                for n in sizes + ([0] if draft is not None else []):
                    runner, rows = (target, ids[ctx:ctx + n]) if n else (draft, ids[ctx:ctx + 1])
                    sync()
                    t0 = time.perf_counter()
                    out = runner.forward_rows([(0, ctx, rows)], all_logits=n > 0)
                    int(out[0][-1].argmax())  # the step's own use of its logits (and a device sync)
                    if rnd:
                        times[n].append(time.perf_counter() - t0)
        # Each cost is its fastest round. Interference from other work on the machine only ever slows a
        # pass down, so the minimum is the steadiest estimate of a pass's own cost (medians of per-round
        # ratios still moved the draft/verify ratio by 0.26-0.41 between calibrations).
        for n, ts in times.items():
            if ts:
                if n:
                    costs.add(ctx, n, min(ts))
                else:
                    costs.add_draft(ctx, min(ts))
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
        # Demand a margin: acceptance is an estimate and the machine's speed drifts, so leaving plain
        # decoding must promise a clear gain (10%), and a deeper k a small one (2%).
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


_CALIBRATED: dict[str, "CostModel"] = {}  # this process's calibrations by calibration_key


class AdaptiveK:
    """A proposer's adaptive-k policy: each request's k per draft kind (looked up in the context, or from a
    draft model), and what each verification teaches it. With ``enabled`` off, k is always the cap and the
    counts are still kept (they cost nothing and say how each kind fares)."""

    def __init__(self, enabled: bool = False, costs: CostModel | None = None):
        self.enabled = enabled
        self.costs = costs if costs is not None else CostModel()

    def calibrate(self, target, draft, k_max: int, max_len: int, identity: dict[str, Any],
                  refresh: bool = False) -> CostModel:
        """Pass costs for this policy (see ``calibrate``), kept per model files, weight formats, CPU, kernel
        path and threads (``identity`` plus the files of its "target" and "draft" paths) in the cache folder,
        so that only the first engine start with a given setup times passes. ``refresh``: time them again."""
        import copy

        from specdecode.models.default_models import cache_dir

        k_max = max(1, min(k_max, max_len - 2))
        parts = dict(identity, target=_file_identity(identity.get("target")),
                     draft=_file_identity(identity.get("draft")) if draft is not None else None,
                     rows=calibration_rows(k_max), max_len=max_len)
        key = calibration_key(parts)
        if refresh or key not in _CALIBRATED:
            t0 = time.perf_counter()
            costs, hit = cached_calibration(key, lambda: calibrate(target, draft, k_max, max_len), cache_dir(),
                                            refresh)
            if not hit:
                logger.info("Calibrated adaptive speculation costs in %.1f s (kept for later starts)",
                            time.perf_counter() - t0)
            _CALIBRATED[key] = costs
        self.costs = copy.deepcopy(_CALIBRATED[key])
        return self.costs

    def choose(self, r, cap: int, lookup: bool) -> int:
        """k for r's drafts of one kind: the cap, or the best k for that kind's own acceptance."""
        if not (cap and self.enabled):
            return cap
        return next_k(cap, r.lookup_acceptance if lookup else r.acceptance, self.costs, lookup,
                      len(r.all_token_ids))

    def lookup_depth(self, r, cap: int) -> int:
        """How deep a lookup may draft for r without touching its probing state: the cap, or the best k for
        the lookups' own acceptance (0 while they do not pay)."""
        if not self.enabled:
            return cap
        return choose_k(*r.lookup_acceptance.rates(self.costs.lookup_prior), cap, self.costs, True,
                        len(r.all_token_ids))

    def draft_model_wins(self, r, lookup_k: int, draft_k: int) -> bool:
        """Whether the draft model drafting draft_k tokens is expected to give more tokens/s for r than a
        lookup of lookup_k tokens (only ever with adaptive k: without it a lookup found is a lookup used)."""
        if not (self.enabled and lookup_k and draft_k):
            return False
        ctx = len(r.all_token_ids)
        return (self.costs.expected_rate(r.lookup_acceptance, lookup_k, True, ctx)
                < self.costs.expected_rate(r.acceptance, draft_k, False, ctx))

    def learn(self, r, drafted: list[int], accepted: int, looked_up: bool, found: list[int],
              emitted: list[int], copied_from: int | None) -> None:
        """Teach the counts what this step showed about each draft kind of r. ``found``: a lookup that was
        available but not used; ``copied_from``: where a copy opened by draft-model tokens begins."""
        costs = self.costs
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
_COSTS_VERSION = 1
_COSTS_FILE = "adaptive_costs.json"
_MAX_CACHED_COSTS = 64


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
            "draft": {str(ctx): s for ctx, s in c.draft.items()}}


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
    if not c.verify:
        raise ValueError("empty cost entry")
    return c


def cached_calibration(key: str, run: Callable[[], CostModel], directory: Path | None,
                       refresh: bool = False) -> tuple[CostModel, bool]:
    """The calibration stored under ``key`` in ``directory`` (see calibration_key), else ``run()``'s result,
    stored for the next engine start (``refresh``: always run, and replace what is stored). Returns (costs,
    whether they came from the cache). A missing, corrupt or unwritable cache only costs the calibration:
    it is never an error."""
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
    entries[key] = dict(_costs_to_json(costs), saved=time.time())
    if len(entries) > _MAX_CACHED_COSTS:  # keep the newest entries
        keep = sorted(entries, key=lambda k: entries[k].get("saved", 0) if isinstance(entries[k], dict) else 0)
        for k in keep[:len(entries) - _MAX_CACHED_COSTS]:
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
