"""Runs one LLMEngine in a background thread and serves it to asyncio code.

``LLMEngine.step()`` and ``add_request()`` must never run at the same time, so everything that touches the
engine happens on a single thread. Callers on an event loop talk to it through a command queue (adds and
aborts); the thread drains the queue, steps while there is work, and sleeps on a condition variable when idle.
Outputs travel back with ``loop.call_soon_threadsafe`` into one asyncio queue per request.

Outputs are cumulative (text and token ids so far), so a slow consumer simply skips to the newest one.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from typing import Any, AsyncIterator, Callable

from specdecode.engine.llm_engine import LLMEngine
from specdecode.engine.scheduler import QueueFullError
from specdecode.outputs import RequestMetrics, RequestOutput
from specdecode.sampling_params import SamplingParams
from specdecode.speculative.metrics import SpecDecodeStats

logger = logging.getLogger("specdecode")

__all__ = ["AsyncLLMEngine", "RequestStream", "EngineDeadError", "EngineStepError", "QueueFullError",
           "RequestFailedError"]

StepCallback = Callable[[list[RequestOutput], LLMEngine, float], None]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shutdown); no request can be served."""


class EngineStepError(RuntimeError):
    """An engine step raised; the requests that were in flight are failed with this error."""


class RequestFailedError(RuntimeError):
    """This request failed alone inside the engine (its output has finish_reason "error"); the others go on."""


class _Stream:
    """Engine-thread side of one request: where its outputs go."""

    __slots__ = ("request_id", "loop", "queue", "finished")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class RequestStream:
    """Async iterator over one request's cumulative RequestOutputs; the last one has ``finished=True``.

    Leaving it early (``close()``, cancellation, an exception in the consumer) must abort the request:
    use ``async with`` or call ``close()`` in a ``finally``."""

    def __init__(self, engine: "AsyncLLMEngine", stream: _Stream):
        self._engine = engine
        self._s = stream
        self.request_id = stream.request_id
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        q = self._s.queue
        item = await q.get()
        # Outputs are cumulative: when several are queued, only the newest matters (errors always win).
        while not q.empty() and not isinstance(item, BaseException):
            item = q.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Aborts the request unless it already finished. Idempotent."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class AsyncLLMEngine:
    """``await engine.add_request(...)`` or ``async for out in engine.generate(...)`` from any event loop."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], step_callback: StepCallback | None = None,
                 error_callback: Callable[[list[str]], None] | None = None, *, wait: bool = True):
        """``engine`` is an engine, or a factory that the engine thread calls to build one. With ``wait=False``
        the constructor returns while the factory still runs; ``wait_built()`` then waits for it (and raises
        its error), so a caller can do other start-up work meanwhile.

        Why a factory: OpenMP keeps a thread team per thread that has run parallel work. If the models load
        on the caller's thread and then run on the engine thread, the two teams share the cores and every
        parallel torch op on the engine thread gets several times slower (measured: SDPA 3-4x, a whole
        speculative step 1.7x). Built by the engine thread, all parallel work stays on one thread."""
        self.engine: LLMEngine = engine if isinstance(engine, LLMEngine) else None  # type: ignore[assignment]
        self.step_callback = step_callback
        self.error_callback = error_callback
        self._cv = threading.Condition()
        self._commands: deque[tuple] = deque()
        self._streams: dict[str, _Stream] = {}
        self._children: dict[str, list] = {}  # request id -> the engine's per-sample requests (n > 1)
        self._stopping = False
        self._dead: BaseException | None = None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        factory = None if self.engine is not None else engine
        self._thread = threading.Thread(target=self._loop, args=(factory,), name="specdecode-engine", daemon=True)
        self._thread.start()
        if wait:
            self.wait_built()

    def wait_built(self) -> "AsyncLLMEngine":
        """Waits until the engine thread has built the engine; raises the error that building it raised."""
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        return self

    @classmethod
    def from_kwargs(cls, *, wait: bool = True, **kwargs: Any) -> "AsyncLLMEngine":
        return cls(lambda: LLMEngine.from_kwargs(**kwargs), wait=wait)

    # ---- properties the server reads ----
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def token_text(self):
        """The engine's cached decode of one token (``LLMEngine.token_text``)."""
        return self.engine.token_text

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ---- caller side (event loop) ----
    async def add_request(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                          prompt_token_ids: list[int] | None = None, suffix: str | None = None) -> RequestStream:
        """Queues the request and waits until the engine accepted it. ``suffix``: fill in the middle between
        the prompt and it (``InputProcessor.encode_prompt``).

        Raises what ``LLMEngine.add_request`` raises (ValueError for a bad prompt, QueueFullError when the
        waiting queue is full) and EngineDeadError after shutdown."""
        loop = asyncio.get_running_loop()
        if self._stopping or self._dead is not None:
            raise EngineDeadError("The engine is shut down and accepts no new requests.")
        truncate = params.truncate_prompt_tokens
        if prompt_token_ids is None or suffix or truncate is not None:
            # Tokenizing (megabytes, at worst) happens in a worker thread, never on the engine thread, so one
            # large prompt cannot stall the running streams.
            prompt_token_ids = await loop.run_in_executor(None, self.engine.input_processor.encode_prompt, prompt,
                                                          prompt_token_ids, suffix, truncate)
        predicted = None
        if params.prediction:  # tokenized off the engine thread too
            predicted = await loop.run_in_executor(None, self.engine.input_processor.encode_prediction,
                                                   params.prediction)
        stream = _Stream(request_id, loop)
        accepted: asyncio.Future = loop.create_future()
        self._submit(("add", stream, prompt, params, prompt_token_ids, accepted, predicted))
        try:
            await accepted
        except asyncio.CancelledError:
            # The caller went away before the engine got to the request: abort it (adds and aborts are
            # handled in order, so this also covers an add that is still queued).
            self.abort(request_id)
            raise
        return RequestStream(self, stream)

    async def generate(self, request_id: str, prompt: str | list[int] | None, params: SamplingParams,
                       prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params, prompt_token_ids)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()  # a consumer that stopped early (disconnect, cancel) aborts the request

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request finishes with finish_reason 'abort' at the next step."""
        if not self._stopping:
            self._submit(("abort", request_id))

    def fail_in_flight(self, message: str) -> None:
        """Thread-safe: ends every request in flight with EngineDeadError(message) and aborts it in the engine
        (the server's last word to its streams before a shutdown deadline cuts them)."""
        self._submit(("fail_all", message))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop; requests still in flight get EngineDeadError. Idempotent."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _submit(self, cmd: tuple) -> None:
        with self._cv:
            if self._stopping or self._dead is not None:
                dead = True
            else:
                dead = False
                self._commands.append(cmd)
                self._cv.notify()
        if dead and cmd[0] == "add":
            cmd[5].set_exception(EngineDeadError("The engine is shut down and accepts no new requests."))

    # ---- engine thread ----
    def _loop(self, factory: Callable[[], LLMEngine] | None) -> None:
        if factory is not None:
            try:
                self.engine = factory()
            except BaseException as e:  # a bad model path or config: the caller raises it
                self._build_error = e
                self._built.set()
                return
        self._built.set()
        try:
            while True:
                with self._cv:
                    while not self._commands and not self._stopping and not self.engine.has_unfinished_requests():
                        self._cv.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                for cmd in commands:
                    self._handle(cmd, stopping)
                if stopping:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # pragma: no cover - a bug in the loop itself; never die silently
            logger.exception("The engine loop crashed")
            self._dead = e
        finally:
            with self._cv:
                self._stopping = True
                leftover = list(self._commands)
                self._commands.clear()
            for cmd in leftover:
                self._handle(cmd, True)
            self._fail_all(EngineDeadError("The server is shutting down; the request was not completed."))

    def _handle(self, cmd: tuple, stopping: bool) -> None:
        if cmd[0] == "abort":
            if not stopping:
                self.engine.abort_request(cmd[1])
            return
        if cmd[0] == "fail_all":
            for rid in list(self._streams):
                self.engine.abort_request(rid)
            self._fail_all(EngineDeadError(cmd[1]))
            return
        _, stream, prompt, params, ids, accepted, predicted = cmd
        rid = stream.request_id
        try:
            if stopping:
                raise EngineDeadError("The server is shutting down and accepts no new requests.")
            if rid in self._streams:
                raise ValueError(f"Request id {rid!r} is already in use.")
            self.engine.add_request(rid, prompt, params, prompt_token_ids=ids, prediction_token_ids=predicted)
        except Exception as e:
            self._resolve(stream.loop, accepted, e)
            return
        self._streams[rid] = stream
        children = getattr(self.engine, "_parents", {}).get(rid)
        if children is not None and len(children) > 1:
            self._children[rid] = list(children)
        self._resolve(stream.loop, accepted, None)

    @staticmethod
    def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, exc: BaseException | None) -> None:
        def done() -> None:
            if fut.done():  # the caller was cancelled meanwhile
                return
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)
        try:
            loop.call_soon_threadsafe(done)
        except RuntimeError:
            pass

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("An engine step failed; failing the requests in flight")
            failed = list(self._streams)
            self._reset_engine()  # first, so the slots are free by the time the callers hear of the error
            self._fail_all(EngineStepError(f"Internal engine error ({type(e).__name__}: {e}); "
                                           "the request was aborted."))
            if self.error_callback is not None:
                try:
                    self.error_callback(failed)
                except Exception:
                    logger.exception("error_callback failed")
            return
        now = time.time()
        outputs = [self._snapshot(o) for o in outputs]
        for out in outputs:
            if out.error and not out.finished:  # one of n samples failed: the request as a whole has
                self.engine.abort_request(out.request_id)
            if out.finished or out.error:
                self._children.pop(out.request_id, None)
                stream = self._streams.pop(out.request_id, None)
            else:
                stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(RequestFailedError(f"The request failed: {out.error}") if out.error else out)
        if self.step_callback is not None:
            try:
                self.step_callback(outputs, self.engine, now)
            except Exception:
                logger.exception("step_callback failed")

    def _snapshot(self, out: RequestOutput) -> RequestOutput:
        """Detaches an output from live engine state before it crosses threads.

        Logprob lists and metrics are shared with the engine's requests and keep changing; for n > 1 the
        spec-decode stats of all samples are summed (the engine reports the first sample's)."""
        for c in out.outputs:
            if c.logprobs is not None:
                c.logprobs = list(c.logprobs[:len(c.token_ids)])
        m = out.metrics
        if m is not None:
            children = self._children.get(out.request_id)
            if children:
                spec = SpecDecodeStats()
                for ch in children:
                    spec.merge(ch.metrics.spec_decode)
                firsts = [ch.metrics.first_token_time for ch in children if ch.metrics.first_token_time]
                ends = [ch.metrics.finished_time for ch in children if ch.metrics.finished_time]
                predicted = [ch.metrics for ch in children if ch.metrics.accepted_prediction_tokens is not None]
                done = out.finished and len(predicted) == len(children)
                m = RequestMetrics(m.arrival_time, min(firsts) if firsts else None,
                                   max(ends) if out.finished and ends else None,
                                   min(ch.metrics.num_cached_tokens for ch in children), spec_decode=spec,
                                   accepted_prediction_tokens=sum(c.accepted_prediction_tokens for c in predicted)
                                   if done else None,
                                   rejected_prediction_tokens=sum(c.rejected_prediction_tokens for c in predicted)
                                   if done else None)
            else:
                s = m.spec_decode
                m = dataclasses.replace(m, spec_decode=SpecDecodeStats(s.num_drafts, s.num_draft_tokens,
                                                                       s.num_accepted_tokens,
                                                                       list(s.accepted_per_pos)))
            out.metrics = m
        return out

    def _fail_all(self, error: BaseException) -> None:
        streams = list(self._streams.values())
        self._streams.clear()
        self._children.clear()
        for s in streams:
            s.put(error)

    def _reset_engine(self) -> None:
        """After a failed step the engine's batch is in an unknown state: drop every request and free slots."""
        from specdecode.engine.request import Status

        sched = self.engine.scheduler
        try:
            sched.take_aborted()
        except Exception:
            pass
        for r in list(sched.running) + list(sched.waiting):
            r.status, r.finish_reason = Status.FINISHED, "abort"
            sched.release(r)
        sched.waiting.clear()
        sched.running.clear()
        parents = getattr(self.engine, "_parents", None)
        if isinstance(parents, dict):
            parents.clear()
