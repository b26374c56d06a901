"""Admission, cache slots, KV blocks and request lifetimes. Thread-safe for add/abort from a server thread.

A request is admitted when a slot is free and the KV cache has blocks for its tokens so far. When the
running requests outgrow the cache, the most recently admitted one is preempted: its blocks are released and
it waits at the head of the queue, to be prefilled again (what it computed from its prompt is usually still
in the prefix cache)."""
from __future__ import annotations

import threading
from collections import deque

from specdecode.engine.block_pool import BlockPool
from specdecode.engine.request import Request, Status


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured limit; the caller should retry later."""


class Scheduler:
    def __init__(self, max_num_seqs: int, max_waiting: int, pool: BlockPool | None = None):
        self.max_num_seqs = max_num_seqs
        self.pool = pool
        self.num_preemptions = 0
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._aborts: set[str] = set()
        self._lock = threading.Lock()

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

    def take_aborted(self, parent_of) -> list[Request]:
        """Finishes requests whose (parent) id was aborted; returns them."""
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            if not aborts:
                return []
            hit = [r for r in list(self.waiting) + self.running if parent_of(r) in aborts]
            self.waiting = deque(r for r in self.waiting if parent_of(r) not in aborts)
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
                if self.pool is not None and self.running and \
                        self.pool.num_free_blocks < self.pool.blocks_needed(None, len(r.all_token_ids)) + 1:
                    break
                self.waiting.popleft()
                r.slot = self.free_slots.pop()
                r.status = Status.RUNNING
                self.running.append(r)
                new.append(r)
        return new

    def release(self, r: Request) -> None:
        if r in self.running:
            self.running.remove(r)
        if r.slot is not None:
            if self.pool is not None:
                self.pool.free(r.slot)
            self.free_slots.append(r.slot)
            r.slot = None

    def preempt(self, r: Request) -> None:
        """Release a running request's slot and blocks and queue it first, to be prefilled again."""
        self.release(r)
        r.status = Status.WAITING
        r.num_computed = r.draft_computed = 0
        r.prefill_end = len(r.all_token_ids) - 1  # the newest token is fed by its next decode step
        r.prefix_checked, r.resumed = False, True
        self.num_preemptions += 1
        with self._lock:
            self.waiting.appendleft(r)
