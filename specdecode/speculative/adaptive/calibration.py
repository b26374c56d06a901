"""Timing the passes adaptive k weighs: target passes over the row counts a step can verify, and draft passes
over the row counts a batched draft step or a catch-up feeds, each after a short and a long context.

The result (a ``CostModel``) is kept on disk per setup (cache.py), so only the first engine start times it.
"""
from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

from specdecode.cpu_share import cpu_times, other_cpu_share
from specdecode.speculative.adaptive.costs import CostModel

if TYPE_CHECKING:
    import torch

MAX_CALIBRATED_ROWS = 256  # beyond this a pass's cost is extrapolated (it is linear in the rows by then)
_BIG = 16                  # passes over more rows are timed fewer times: they last long enough to be steady
# The contexts passes are timed after (clamped to the engine's max_len). Attention's share of a pass grows with
# the context, and each row a verification adds costs more the deeper it is (every row has its own scores
# against every key), which no line through two short contexts predicts: the long one is timed too.
CONTEXTS = (32, 512, 8192)
_REAL_CONTEXT = 512  # contexts up to this are a real prefill; longer ones repeat it (KVCache.repeat)
_LONG_ROUNDS = 3     # timed rounds after a repeated context: its passes are long enough to be steady
VERSION = 4  # part of the cost cache's key: costs timed another way (an earlier version) are timed again


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


@contextlib.contextmanager
def _scoring_with(draft, head: torch.nn.Module | None):
    """For the block, the draft runner's model scores with ``head`` (None: whatever it has); afterwards with
    the head it had. Proposers that share one draft model each put their own head in place when they draft,
    so timing one proposer's head leaves the shared model as it found it."""
    if draft is None or head is None:
        yield
        return
    model = draft.model
    saved, model.lm_head = model.lm_head, head
    try:
        yield
    finally:
        model.lm_head = saved


def calibrate(target, draft, k_max: int, max_len: int, repeats: int = 5,
              contexts: tuple[int, ...] = CONTEXTS, batch: int = 1,
              draft_head: torch.nn.Module | None = None) -> CostModel:
    """Time target passes over the rows of calibration_rows(k_max, batch) and, with a draft runner, draft
    passes over draft_calibration_rows(batch), after each of ``contexts``, on cache slot 0 (call it while no
    request runs: the slot's content is left as scratch; the memory a repeated context took is given back).
    Each round times every row count back to back, after one untimed warm-up round; passes over many rows are
    timed once, and a short draft pass after an untimed draft pass and target pass, as in a step. Rows of one
    slot stand in for rows of many requests: the weights are read once per pass either way. The result's
    ``other_cpu_share`` says how busy the rest of the machine was meanwhile. ``draft_head``: the LM head the
    draft's passes are timed with (a proposer's truncated head; None: the draft model's current one)."""
    with _scoring_with(draft, draft_head):
        return _timed(target, draft, k_max, max_len, repeats, contexts, batch)


def _timed(target, draft, k_max: int, max_len: int, repeats: int, contexts: tuple[int, ...],
           batch: int) -> CostModel:
    import torch

    k_max = max(1, min(k_max, max_len - 2))  # a context of at least 1 plus k_max + 1 rows must fit
    costs = CostModel()
    gen = torch.Generator().manual_seed(0)
    vocab = min(target.vocab_size, draft.vocab_size if draft is not None else target.vocab_size)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    runners = [target] + ([draft] if draft is not None else [])
    cpu0 = cpu_times()
    done = 0  # positions of slot 0 a real prefill computed (before the timed passes wrote past them)
    for ctx in sorted({max(1, min(c, max_len - k_max - 2)) for c in contexts}):
        sizes = [n for n in calibration_rows(k_max, batch) if ctx + n <= max_len]
        dsizes = [n for n in draft_calibration_rows(batch) if ctx + n <= max_len] if draft is not None else []
        passes = [(False, target, n) for n in sizes] + [(True, draft, n) for n in dsizes]
        ids = torch.randint(0, vocab, (ctx + max(sizes + dsizes),), generator=gen).tolist()
        repeated = ctx > _REAL_CONTEXT and done > 0
        with torch.inference_mode():
            for runner in runners:
                if repeated:  # a prefill this long would take a minute; the short contexts warmed up already
                    runner.kv_cache.repeat(0, done, ctx)
                else:
                    # A real prefill, not just any content: its seconds of full-speed work also bring the
                    # process up to the speed it keeps (timed without it, a fresh process's passes ran 15-45%
                    # slower).
                    runner.prefill(0, ids[:ctx])
            times: dict[tuple[bool, int], list[float]] = {(d, n): [] for d, _, n in passes}
            for rnd in range(min(repeats, _LONG_ROUNDS) + 1 if repeated else repeats + 1):
                for is_draft, runner, n in passes:
                    if n > _BIG and rnd != 1:
                        continue  # long enough to be steady in one go, after the small passes warmed up
                    # a verification needs every row's logits; a draft step one per request, a catch-up one
                    all_logits = not is_draft or n <= batch
                    if is_draft and n <= _BIG:
                        # As in a step: a draft pass, a verification, then the timed draft pass. Back to back a
                        # short draft pass ran 3-5 ms faster than between verifications (the caches hold the
                        # other model's data), and right after a row of target passes slower still.
                        runner.forward_rows([(0, ctx, ids[ctx:ctx + 1])], all_logits=False)
                        target.forward_rows([(0, ctx, ids[ctx:ctx + 1])], all_logits=True)
                    sync()
                    t0 = time.perf_counter()
                    out = runner.forward_rows([(0, ctx, ids[ctx:ctx + n])], all_logits=all_logits)
                    int(out[0][-1].argmax())  # the step's own use of its logits (and a device sync)
                    if rnd:
                        times[(is_draft, n)].append(time.perf_counter() - t0)
            if repeated:
                for runner in runners:
                    runner.kv_cache.discard(0)
            else:
                done = ctx
        # Each cost is its fastest round. Interference from other work on the machine only ever slows a
        # pass down, so the minimum is the steadiest estimate of a pass's own cost (medians of per-round
        # ratios still moved the draft/verify ratio by 0.26-0.41 between calibrations).
        for (is_draft, n), ts in times.items():
            if ts:
                if is_draft:
                    costs.add_draft(ctx, min(ts), n)
                else:
                    costs.add(ctx, n, min(ts))
    costs.other_cpu_share = other_cpu_share(cpu0, cpu_times())
    return costs


def batch_size(runner) -> int:
    """How many requests the runner's cache holds at once (the largest batch a step can have)."""
    kv = getattr(runner, "kv_cache", None)
    for name in ("num_slots", "max_num_seqs"):
        n = getattr(kv, name, None) or getattr(runner, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return 1
