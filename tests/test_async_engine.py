"""AsyncLLMEngine: one engine thread, asyncio callers, aborts on cancel, errors never kill the loop silently."""
from __future__ import annotations

import asyncio

import pytest

from specdecode import SamplingParams
from specdecode.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError
from specdecode.engine.scheduler import QueueFullError

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def engine(tiny_models, tiny_draft):
    eng = AsyncLLMEngine.from_kwargs(model=str(tiny_models["llama"]), speculative_model=str(tiny_draft),
                                     num_speculative_tokens=2, max_model_len=256, max_num_seqs=2,
                                     max_waiting_requests=8)
    yield eng
    eng.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def final(engine, rid, prompt, params=GREEDY):
    out = None
    async for out in engine.generate(rid, prompt, params):
        pass
    return out


def test_generate_many_concurrently(engine):
    async def main():
        return await asyncio.gather(*(final(engine, f"c{i}", f"prompt number {i}") for i in range(7)))

    outs = run(main())
    assert [o.request_id for o in outs] == [f"c{i}" for i in range(7)]
    assert all(o.finished and o.outputs[0].finish_reason in ("stop", "length") for o in outs)
    alone = run(final(engine, "alone", "prompt number 3"))
    assert alone.outputs[0].text == outs[3].outputs[0].text
    assert engine.engine.scheduler.running == [] and len(engine.engine.scheduler.free_slots) == 2


def test_add_errors_propagate(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        run(final(engine, "long", [5] * 300))
    with pytest.raises(ValueError, match="waiting limit"):  # could never be queued while busy: not a 503
        run(final(engine, "wide", "x", SamplingParams(n=9, max_tokens=2)))

    async def dup():
        s = await engine.add_request("dup", "x", SamplingParams(max_tokens=50, ignore_eos=True))
        try:
            with pytest.raises(ValueError, match="already in use"):
                await engine.add_request("dup", "y", GREEDY)
        finally:
            s.close()
    run(dup())
    assert run(final(engine, "after", "x")).finished  # the loop is still alive


def test_cancel_aborts_and_frees_slot(engine, monkeypatch):
    # The engine thread holds its next step until the caller has cancelled, so the cancel always lands while
    # the request is still running, however fast the machine decodes.
    import threading

    cancelled, running = threading.Event(), threading.Event()
    step = engine.engine.step

    def held_step():
        if running.is_set():  # the last step handed the caller an unfinished output of "cancel-me"
            assert cancelled.wait(30), "the caller never cancelled"
        outs = step()
        if any(o.request_id == "cancel-me" and not o.finished for o in outs):
            running.set()
        return outs

    monkeypatch.setattr(engine.engine, "step", held_step)

    async def main():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate("cancel-me", "hello", params):
                started.set()

        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        cancelled.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not engine.engine.has_unfinished_requests() and len(engine.engine.scheduler.free_slots) == 2:
                break
        return await final(engine, "next", "hello")

    out = run(main())
    assert out.finished
    assert len(engine.engine.scheduler.free_slots) == 2 and not engine.engine.has_unfinished_requests()


def test_n2_merges_spec_stats(engine):
    out = run(final(engine, "n2", "abc", SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=10,
                                                          ignore_eos=True)))
    assert len(out.outputs) == 2
    assert out.metrics.spec_decode.num_drafts >= 2  # both samples' verification passes are counted


def test_step_exception_fails_in_flight_requests_only(engine, monkeypatch):
    real_step = engine.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", flaky_step)
    with pytest.raises(EngineStepError, match="boom"):
        run(final(engine, "victim", "x", SamplingParams(max_tokens=50, ignore_eos=True)))
    assert len(engine.engine.scheduler.free_slots) == 2
    assert run(final(engine, "survivor", "x")).finished  # the loop keeps serving


def test_shutdown_fails_in_flight_and_rejects_new(tiny_models):
    eng = AsyncLLMEngine.from_kwargs(model=str(tiny_models["llama"]), max_model_len=256, max_num_seqs=1)

    async def main():
        stream = await eng.add_request("r", "x", SamplingParams(max_tokens=200, ignore_eos=True))
        await stream.__anext__()
        eng.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request("r2", "x", GREEDY)

    run(main())
    assert not eng.is_running


def test_speculation_off_at_batch_size(tiny_models, tiny_draft):
    eng = AsyncLLMEngine.from_kwargs(model=str(tiny_models["llama"]), speculative_model=str(tiny_draft),
                                     num_speculative_tokens=2, max_model_len=128, max_num_seqs=2,
                                     speculative_disable_by_batch_size=1)
    try:
        out = run(final(eng, "a", "hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
        assert len(out.outputs[0].token_ids) == 8
        assert eng.engine.spec_stats.num_drafts == 0 and out.metrics.spec_decode.num_draft_tokens == 0
    finally:
        eng.shutdown()


def test_models_are_built_on_the_engine_thread(tiny_models):
    # All parallel torch work must stay on one thread: a second OpenMP team on the caller's thread makes
    # every op on the engine thread several times slower. So from_kwargs builds the engine in its thread.
    import threading

    from specdecode.engine.llm_engine import LLMEngine

    seen = {}

    def build():
        seen["thread"] = threading.current_thread()
        return LLMEngine.from_kwargs(model=str(tiny_models["llama"]), max_model_len=64, max_num_seqs=1)

    eng = AsyncLLMEngine(build)
    try:
        assert seen["thread"] is eng._thread and seen["thread"] is not threading.current_thread()
        out = run(final(eng, "t", "hello", SamplingParams(temperature=0, max_tokens=3)))
        assert len(out.outputs[0].token_ids) == 3
    finally:
        eng.shutdown()


def test_build_error_reaches_the_caller(tmp_path):
    with pytest.raises(ValueError, match="does not exist|not found"):
        AsyncLLMEngine.from_kwargs(model=str(tmp_path / "missing"))
