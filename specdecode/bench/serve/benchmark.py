"""The runs of ``bench serve``: the workload sent at each concurrency limit and request rate (Poisson arrivals
of requests, or of conversations with ``--multi-turn``), after the warm-up requests; and the JSON result."""
from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from specdecode.bench.serve.client import (ClientConfig, RequestRecord, discover_model, metrics_delta,
                                           scrape_metrics, send_request)
from specdecode.bench.serve.report import rate_label, summarize_run
from specdecode.bench.serve.workload import Conversation, Workload


@dataclass
class RunState:
    max_concurrency: int | None
    request_rate: float
    start: float = 0.0
    duration: float | None = None
    records: list[RequestRecord] = field(default_factory=list)
    skipped_turns: int = 0
    in_flight: int = 0
    metrics: dict = field(default_factory=dict)
    interrupted: bool = False


@dataclass
class BenchState:
    """Everything measured so far: read after a Ctrl+C for the partial summary."""
    model: str | None = None
    runs: list[RunState] = field(default_factory=list)
    warmup_error: str | None = None


class ServeBenchmark:
    def __init__(self, cfg: ClientConfig, workload: Workload, concurrencies: list[int | None],
                 rates: list[float], seed: int = 0, num_warmups: int = 1, tokenizer=None, progress: bool = False,
                 on_record: Callable[[RequestRecord], None] | None = None):
        self.cfg = cfg
        self.workload = workload
        self.concurrencies = concurrencies
        self.rates = rates
        self.seed = seed
        self.num_warmups = num_warmups
        self.tokenizer = tokenizer
        self.progress = progress
        self.on_record = on_record
        self.state = BenchState()

    async def run(self) -> BenchState:
        import httpx

        n = max(c or self.workload.num_requests for c in self.concurrencies) + 4
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(limits=limits, timeout=self.cfg.timeout) as client:
            if self.cfg.model is None:
                self.cfg.model = await discover_model(client, self.cfg)
            self.state.model = self.cfg.model
            await self._warmup(client)
            for c in self.concurrencies:
                for rate in self.rates:
                    await self._one_run(client, c, rate)
        return self.state

    async def _warmup(self, client) -> None:
        first = self.workload.items[0].turns[0]
        for _ in range(self.num_warmups):
            prompt = [{"role": "user", "content": first}] if self.cfg.endpoint == "chat" else first
            rec = await send_request(client, self.cfg, prompt, RequestRecord("warmup", 0, 0),
                                     max_tokens=min(16, self.cfg.max_tokens))
            if not rec.success:
                self.state.warmup_error = rec.error
                return

    async def _one_run(self, client, concurrency: int | None, rate: float) -> None:
        run = RunState(concurrency, rate)
        self.state.runs.append(run)
        before = await scrape_metrics(client, self.cfg)
        sem = asyncio.Semaphore(concurrency) if concurrency else None
        rng = random.Random(self.seed)
        bar = self._bar(concurrency, rate)
        run.start = time.perf_counter()
        tasks = []
        try:
            for item in self.workload.items:
                tasks.append(asyncio.create_task(self._conversation(client, item, sem, run, bar)))
                if not math.isinf(rate):
                    await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
        except (asyncio.CancelledError, KeyboardInterrupt):  # Ctrl+C cancels; SIGTERM raises where it lands
            run.interrupted = True
            for t in tasks:
                t.cancel()
            raise
        finally:
            run.duration = time.perf_counter() - run.start
            if bar is not None:
                bar.close()
        run.metrics = metrics_delta(before, await scrape_metrics(client, self.cfg))

    def _bar(self, concurrency: int | None, rate: float):
        if not self.progress:
            return None
        from tqdm import tqdm
        return tqdm(total=self.workload.num_requests, file=sys.stderr, leave=False,
                    desc=f"C={concurrency or 'inf'} rate={rate_label(rate)}")

    async def _conversation(self, client, item: Conversation, sem, run: RunState, bar) -> None:
        async with sem if sem is not None else contextlib.nullcontext():
            history: list[dict] = []
            for t, user in enumerate(item.turns):
                if self.cfg.endpoint == "chat":
                    prompt: str | list[dict] = history + [{"role": "user", "content": user}]
                else:
                    prompt = user
                rec = RequestRecord(item.id, t, len(prompt) if isinstance(prompt, list) else 0)
                rec.start = time.perf_counter() - run.start
                run.in_flight += 1  # until it finishes: what a Ctrl+C drops
                await send_request(client, self.cfg, prompt, rec, self.tokenizer)
                run.in_flight -= 1
                run.records.append(rec)
                if bar is not None:
                    bar.update(1)
                if self.on_record is not None:
                    self.on_record(rec)
                if not rec.success:
                    run.skipped_turns += len(item.turns) - t - 1
                    if bar is not None:
                        bar.update(len(item.turns) - t - 1)
                    return
                if isinstance(prompt, list):
                    history = prompt + [{"role": "assistant", "content": rec.text}]


def build_result(bench: ServeBenchmark, meta: dict) -> dict:
    """The JSON result: meta, and per run its summary and every request record."""
    runs = []
    for run in bench.state.runs:
        duration = run.duration if run.duration is not None else time.perf_counter() - run.start
        summary = summarize_run(run.records, duration, run.metrics, run.skipped_turns, run.in_flight)
        rate = "inf" if math.isinf(run.request_rate) else run.request_rate  # JSON has no infinity
        runs.append({"max_concurrency": run.max_concurrency, "request_rate": rate,
                     "interrupted": run.interrupted, "summary": summary,
                     "requests": [dict(asdict(r), tpot=r.tpot) for r in run.records]})
    meta = dict(meta, model=bench.state.model, warmup_error=bench.state.warmup_error)
    return {"meta": meta, "runs": runs, "interrupted": any(r["interrupted"] for r in runs)}
