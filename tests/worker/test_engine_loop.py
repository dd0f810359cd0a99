"""The engine on its own thread, talked to from asyncio: streams get every token in order, a slow
reader gets them coalesced, call() returns results and raises errors, and the GIL hand-off after
each iteration is bounded: an event loop that is busy cannot stall the engine."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.worker.engine_loop import EngineFailed, EngineLoop
from services.engine.engine import LLMEngine, engine_config
from services.engine.errors import InvalidRequestError
from services.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(engine_config(str(tiny_model_dir), kv_cache_mib=16))


def run_with_loop(engine: LLMEngine, scenario, **loop_kwargs):
    async def main():
        loop = EngineLoop(engine, asyncio.get_running_loop(), **loop_kwargs)
        loop.start()
        try:
            return await scenario(loop)
        finally:
            loop.stop()
    return asyncio.run(main())


def test_a_stream_gets_the_same_tokens_as_the_engine_alone(engine):
    expected = engine.generate([[1, 2, 3, 4]], GREEDY)[0].token_ids

    async def scenario(loop: EngineLoop):
        stream = loop.stream("r1")
        await loop.call(engine.add_request, [1, 2, 3, 4], GREEDY, request_id="r1")
        tokens = [t async for out in stream for t in out.new_token_ids]
        return tokens

    assert run_with_loop(engine, scenario) == list(expected)


def test_a_slow_reader_gets_the_missed_deltas_merged(engine):
    async def scenario(loop: EngineLoop):
        stream = loop.stream("r2")
        await loop.call(engine.add_request, [5, 6, 7], GREEDY, request_id="r2")
        await asyncio.sleep(0.5)                 # the engine finishes meanwhile
        outs = [out async for out in stream]
        return outs

    outs = run_with_loop(engine, scenario)
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 12
    assert len(outs) < 12                        # coalesced, not one read per token


def test_call_raises_the_engines_error_on_the_caller(engine):
    async def scenario(loop: EngineLoop):
        with pytest.raises(InvalidRequestError):
            await loop.call(engine.add_request, [], GREEDY, request_id="empty")
        return await loop.call(engine.has_unfinished)

    assert run_with_loop(engine, scenario) is False


def test_a_blocked_event_loop_delays_each_iteration_by_at_most_the_hand_off_wait(engine):
    """With the event loop blocked for 0.3 s, the engine still runs its iterations: each one
    waits at most handoff_wait_s for the loop, then goes on."""
    async def scenario(loop: EngineLoop):
        stream = loop.stream("r3")
        await loop.call(engine.add_request, [9, 8, 7], GREEDY, request_id="r3")
        time.sleep(0.3)                          # blocks the event loop, not the engine thread
        return [out async for out in stream]

    outs = run_with_loop(engine, scenario, handoff_wait_s=0.005)
    assert outs[0].finished                      # all 12 tokens were made during the block
    assert len(outs[0].new_token_ids) == 12


def test_an_idle_engine_answers_a_call_inline_and_a_busy_one_in_order(engine):
    """Idle: the call runs on the caller's thread, no hop to the engine thread. Busy with a
    command issued earlier: the call waits its turn behind it."""
    async def scenario(loop: EngineLoop):
        inline_thread = await loop.call(threading.get_ident)
        order: list[str] = []
        gate = threading.Event()
        loop.submit(lambda: (gate.wait(5), order.append("first")))
        threading.Timer(0.2, gate.set).start()
        queued_thread = await loop.call(lambda: (order.append("second"), threading.get_ident())[1])
        return inline_thread, queued_thread, order

    inline_thread, queued_thread, order = run_with_loop(engine, scenario)
    assert inline_thread == threading.get_ident()
    assert queued_thread != threading.get_ident()
    assert order == ["first", "second"]


def test_an_engine_failure_fails_every_waiter_and_is_reported_once(tiny_model_dir):
    """[H2]: an exception out of step() must never leave a stream or a call() hanging."""
    engine = LLMEngine(engine_config(str(tiny_model_dir), kv_cache_mib=16))
    calls = {"n": 0}
    real_step = engine.step

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = failing_step
    reported: list[EngineFailed] = []

    async def scenario(loop: EngineLoop):
        streams = [loop.stream(f"f{i}") for i in range(3)]
        for i in range(3):
            await loop.call(engine.add_request, [1, 2, 3], GREEDY, request_id=f"f{i}")
        for stream in streams:
            with pytest.raises(EngineFailed, match="injected step failure"):
                async for _ in stream:
                    pass
        with pytest.raises(EngineFailed):
            await loop.call(engine.stats)
        late = loop.stream("late")          # a stream opened after the failure fails at once
        with pytest.raises(EngineFailed):
            await asyncio.wait_for(late.next(), 5)
        return loop.failure

    failure = run_with_loop(engine, scenario, on_failure=reported.append)
    assert isinstance(failure, EngineFailed) and reported == [failure]
