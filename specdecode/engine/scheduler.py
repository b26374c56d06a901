"""Scheduling: admission, cache slots, KV blocks, prompt chunks and preemption. Thread-safe for add/abort from
a server thread; everything else runs on the engine's thread.

A request is admitted when a slot is free and the KV cache has blocks for its tokens so far. A step first
gives each decoding request blocks for its verification rows (``schedule``); after the verification pass, what
is left of the step's token budget goes to prompt chunks (``schedule_prefill``). When the running requests
outgrow the cache, the most recently admitted one is preempted: its blocks are released and it waits at the
head of the queue, to be prefilled again (what it computed is usually still in the prefix cache)."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from specdecode.engine.block_pool import BLOCK_SIZE, BlockPool
from specdecode.engine.model_runner import ModelRunner
from specdecode.engine.request import Request, Status

logger = logging.getLogger("specdecode")

# Prompt tokens one step may prefill (with the running requests' verification rows) unless
# max_num_batched_tokens says otherwise: chunks this size keep streams moving during a long prefill while
# each chunk still amortises one read of the weights over many tokens.
DEFAULT_BATCHED_TOKENS = 256

# The most prompt rows one pass computes for a request that wants its prompt's logprobs: each row's logits span
# the vocabulary, so a chunk's are this many rows of it at most.
PROMPT_LOGPROBS_ROWS = 256


@dataclass
class SchedulerOutput:
    """A step's start, before its passes."""
    aborted: list[Request]    # finished by an abort since the last step
    decode: list[Request]     # running requests past their prompts, each with blocks for its verification rows
    preempted: list[Request]  # running requests that gave their blocks up for older ones, to be prefilled again


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured limit; the caller should retry later."""


class Scheduler:
    def __init__(self, max_num_seqs: int, max_waiting: int, pool: BlockPool, target: ModelRunner,
                 max_model_len: int, max_num_batched_tokens: int | None = None, draft: ModelRunner | None = None):
        """``target``: the target's runner, whose cache a prefix-cache hit on part of a block is copied in and
        which tells whether a prompt chunk may start inside a block; ``max_num_batched_tokens``: the tokens one
        step computes (verification rows and prompt chunks); ``draft``: the draft model's runner, whose cache
        shares the blocks (a prefix-cache hit then covers its cache too where the block records it)."""
        self.max_num_seqs = max_num_seqs
        self.pool = pool
        self.target = target
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens or DEFAULT_BATCHED_TOKENS
        self.draft = draft
        self.num_preemptions = 0
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._aborts: set[str] = set()
        self._lock = threading.Lock()

    # ---- requests in and out (any thread) ----
    def add(self, reqs: list[Request]) -> None:
        """Queues one request's samples together. The waiting limit counts only the requests that cannot be
        admitted now: those beyond the free slots."""
        if len(reqs) > max(self.max_waiting, 1):
            # Such a request fits only while enough slots happen to be free: refuse it for good, not "retry".
            raise ValueError(f"n={len(reqs)} samples exceed the waiting limit of {self.max_waiting} requests, so "
                             "this request could not be queued while the server is busy; lower n or raise "
                             "max_waiting_requests.")
        with self._lock:
            if len(self.waiting) + len(reqs) - len(self.free_slots) > self.max_waiting:
                raise QueueFullError(f"The waiting queue is full ({self.max_waiting} requests); retry later.")
            self.waiting.extend(reqs)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----
    def schedule(self, reach: int) -> SchedulerOutput:
        """Start a step: finish the aborted requests, admit waiting ones, and give each running request past its
        prompt blocks for ``reach`` drafts' verification rows, oldest first, preempting the youngest while
        the cache is short. Prompt chunks are planned after the verification pass (``schedule_prefill``): the
        budget they get is what its rows leave, known only once the drafts are."""
        aborted = self.take_aborted()
        for r in aborted:
            r.metrics.finished_time = time.time()
        self.admit()
        preempted: list[Request] = []
        decode = [r for r in self.running if not r.prefilling and not r.finished]
        for r in decode:
            if r.status is Status.RUNNING and not self._reserve(r, min(len(r.all_token_ids) + reach,
                                                                       self.max_model_len), preempted):
                self.preempt(r, preempted)
        return SchedulerOutput(aborted, [r for r in decode if r.status is Status.RUNNING], preempted)

    def take_aborted(self) -> list[Request]:
        """Finishes requests whose (parent) id was aborted; returns them."""
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            if not aborts:
                return []
            hit = [r for r in list(self.waiting) + self.running if r.request_id in aborts]
            self.waiting = deque(r for r in self.waiting if r.request_id not in aborts)
        for r in hit:
            r.status, r.finish_reason = Status.FINISHED, "abort"
            self.release(r)
        return hit

    def admit(self) -> list[Request]:
        new = []
        with self._lock:
            while self.waiting and self.free_slots:
                r = self.waiting[0]
                # its tokens so far and one block to grow into; a prefix-cache hit only makes it need less
                if self.running and \
                        self.pool.num_free_blocks < self.pool.blocks_needed(None, len(r.all_token_ids)) + 1:
                    break
                self.waiting.popleft()
                r.slot = self.free_slots.pop()
                r.status = Status.RUNNING
                self.running.append(r)
                new.append(r)
        return new

    def schedule_prefill(self, used: int, preempt: bool = True) -> dict[Request, int]:
        """The prompt chunks a pass prefills, oldest request first, within what ``used`` tokens (the step's
        verification rows) leave of max_num_batched_tokens. A request whose next block another chunk of this
        step computes from the same tokens waits a step: it then finds that block in the prefix cache instead of
        computing it twice (a shared system prompt). Without ``preempt``, chunks stop where blocks would have to
        be taken from a running request."""
        budget = self.max_num_batched_tokens - used
        preempted: list[Request] | None = [] if preempt else None
        chunks: dict[Request, int] = {}
        for r in [r for r in self.running if r.prefilling and not r.finished]:
            if r.status is not Status.RUNNING:
                continue  # preempted by an older request's chunk
            self._use_prefix_cache(r)
            every_row = r.needs_prompt_logprobs
            if chunks and not every_row and self._computed_by(chunks, r):
                continue
            n = self._chunk(r, min(budget, PROMPT_LOGPROBS_ROWS) if every_row else budget, not chunks)
            if n == 0 or not self._reserve(r, r.num_computed + n, preempted):
                break
            chunks[r] = n
            budget -= n
        return chunks

    def schedule_joined_prefill(self, used: int) -> dict[Request, int]:
        """The prompt chunks to compute in the verification pass of ``used`` rows (one read of the weights for
        both), or none: only where prompt rows take the decode rows' path (the C++ stack), so that each row's
        result is what a prefill pass would give; elsewhere the chunks get their own pass after it. Nothing is
        preempted: the requests being verified in this pass must keep their blocks."""
        # (the prompt check first: chunks_start_anywhere checks the layer stack's weights, a few hundred lookups)
        if not any(r.prefilling and not r.finished for r in self.running) or not self.target.chunks_start_anywhere:
            return {}
        return self.schedule_prefill(used, preempt=False)

    def free_finished(self) -> None:
        """Give back the finished requests' slots (their blocks stay in the prefix cache)."""
        for r in [r for r in self.running if r.finished]:
            self._keep_in_cache(r)
            self.release(r)

    # ---- prompt chunks ----
    @staticmethod
    def _chunk(r: Request, budget: int, first: bool) -> int:
        """How many prompt tokens of ``r`` to prefill now: what the budget allows, ending on a block boundary
        unless it is the prompt's end (so that chunks never change a position's result, see
        layers.attention); at least one block for the first prompt in line, so prefill always progresses."""
        left = r.prefill_end - r.num_computed
        n = min(left, budget)
        if n < left:
            n -= (r.num_computed + n) % BLOCK_SIZE
        if n <= 0 and first:
            n = min(left, BLOCK_SIZE - r.num_computed % BLOCK_SIZE)
        return max(n, 0)

    @staticmethod
    def _computed_by(chunks: dict[Request, int], r: Request) -> bool:
        """Whether one of ``chunks`` computes r's next block, from the same tokens before and in it."""
        start = r.num_computed
        end = min(start + BLOCK_SIZE, r.prefill_end)
        if end - start < BLOCK_SIZE:
            return False  # a partial block is never shared
        ids = r.all_token_ids
        return any(o.num_computed <= start and start + BLOCK_SIZE <= o.num_computed + n
                   and o.all_token_ids[start:end] == ids[start:end]  # the block itself first: cheap, usually decisive
                   and o.all_token_ids[:start] == ids[:start] for o, n in chunks.items())

    def _use_prefix_cache(self, r: Request) -> None:
        """Start the request's prefill after the longest prefix the cache holds: whole blocks, then (where a
        chunk may start inside a block) the positions of a partly filled block that continue it, and at least
        its last prompt token left to compute, whose logits give the first output token. Later, while every
        block the request holds came from the cache, take the blocks the cache has gained since (another
        request's chunk computed them from the same tokens)."""
        if r.needs_prompt_logprobs:
            return  # every prompt row's logits are needed: nothing may come from the cache
        limit = r.prefill_end if r.resumed else r.prefill_end - 1
        if r.prefix_checked and (r.num_computed % BLOCK_SIZE or r.num_computed + BLOCK_SIZE > limit):
            return
        blocks, draft_blocks = self.pool.match(r.all_token_ids, limit)
        first, before = not r.prefix_checked, r.num_computed
        if not first:
            have = before // BLOCK_SIZE
            if len(blocks) <= have or self.pool.blocks(r.slot)[:have] != blocks[:have]:
                return
        r.prefix_checked = True
        part = self.pool.match_partial(r.all_token_ids, blocks, limit) if self.target.chunks_start_anywhere else None
        self.pool.attach(r.slot, blocks)
        r.num_computed = len(blocks) * BLOCK_SIZE
        r.draft_computed = draft_blocks * BLOCK_SIZE if self.draft is not None else 0
        if part is not None and self.pool.num_free_blocks > 0:
            # the next positions, copied out of a block another sequence holds (its owner only writes past them)
            self.pool.ensure(r.slot, r.num_computed + part[1])
            mine = self.pool.blocks(r.slot)[-1]
            self.target.kv_cache.copy_positions(part[0], mine, part[1])
            r.num_computed += part[1]
            # the draft's too where it holds them (a shared system prompt's last few tokens, fed again at every
            # draft catch-up otherwise)
            in_draft = min(part[1], self.pool.partial_in_draft(part[0]))
            if self.draft is not None and in_draft and draft_blocks == len(blocks):
                self.draft.kv_cache.copy_positions(part[0], mine, in_draft)
                r.draft_computed += in_draft
        if not r.resumed:
            self.pool.count_query(r.prefill_end if first else 0, r.num_computed - before)
            r.metrics.num_cached_tokens = r.num_computed

    # ---- blocks and slots ----
    def _reserve(self, r: Request, num_tokens: int, preempted: list[Request] | None) -> bool:
        """Blocks for positions [0, num_tokens) of ``r``, preempting requests admitted after it (adding them to
        ``preempted``) while the cache is short, unless ``preempted`` is None; False when only older requests
        hold the rest (``r`` then waits for them)."""
        while self.pool.blocks_needed(r.slot, num_tokens) > self.pool.num_free_blocks:
            younger = self.running[self.running.index(r) + 1:]
            if not younger or preempted is None:
                return False
            victim = younger[-1]
            logger.warning("KV cache full: request %s is preempted and will be prefilled again "
                           "(raise kv_cache_memory or lower max_num_seqs).", victim.request_id)
            self.preempt(victim, preempted)
        self.pool.ensure(r.slot, num_tokens)
        return True

    def _keep_in_cache(self, r: Request) -> None:
        """Register the blocks of a request that gives its slot back. Its full blocks stay in the prefix cache,
        the generated tokens' as well as the prompt's: a chat's next turn re-sends this answer, and a preempted
        request is prefilled again. Row invariance makes a decode step's keys and values the bits a prefill of
        the same tokens writes."""
        if r.slot is not None:
            done = min(r.num_computed, len(r.all_token_ids))  # accepted drafts a stop cut off are not content
            self.pool.register(r.slot, r.all_token_ids, done, min(r.draft_computed, done))

    def release(self, r: Request) -> None:
        """Free the request's slot and blocks (registered blocks stay cached) and drop it from the running."""
        if r in self.running:
            self.running.remove(r)
        if r.slot is not None:
            self.pool.free(r.slot)
            self.free_slots.append(r.slot)
            r.slot = None

    def preempt(self, r: Request, preempted: list[Request]) -> None:
        """Release a running request's slot and blocks and queue it first, to be prefilled again."""
        self._keep_in_cache(r)
        self.release(r)
        r.status = Status.WAITING
        r.num_computed = r.draft_computed = 0
        r.prefill_end = len(r.all_token_ids) - 1  # the newest token is fed by its next decode step
        r.prefix_checked, r.resumed = False, True
        self.num_preemptions += 1
        preempted.append(r)
        with self._lock:
            self.waiting.appendleft(r)
