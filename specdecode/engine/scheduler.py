"""Admission, cache slots and request lifetimes. Thread-safe for add/abort from a server thread."""
from __future__ import annotations

import threading
from collections import deque

from specdecode.engine.request import Request, Status


class QueueFullError(RuntimeError):
    """The waiting queue is at its configured limit; the caller should retry later."""


class Scheduler:
    def __init__(self, max_num_seqs: int, max_waiting: int):
        self.max_num_seqs = max_num_seqs
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
                r = self.waiting.popleft()
                r.slot = self.free_slots.pop()
                r.status = Status.RUNNING
                self.running.append(r)
                new.append(r)
        return new

    def release(self, r: Request) -> None:
        if r in self.running:
            self.running.remove(r)
        if r.slot is not None:
            self.free_slots.append(r.slot)
            r.slot = None
