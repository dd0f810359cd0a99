"""No reservation outlives the caller that asked for it, however late the engine core answers.

A real engine core process behind an EngineClient (the simulated core: the claim is about the
core's reservations and deadlines, which run the real scheduler and block pool whatever makes the
tokens, so no torch to import and no weights to load), stopped with SIGSTOP while a Reserve
waits in its queue (a core busy with one long step looks the same from outside):
  - the caller gives up before its deadline, the core then reserves: the reply is answered by a
    Cancel, the blocks are free again and `abandoned` is told "late";
  - the core reaches the Reserve past its deadline: it reserves nothing and says "expired",
    whether the caller is still waiting (it gets None) or has gone;
  - a Reserve in time is not touched.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import contextmanager

import pytest

from services.engine.engine import engine_config
from services.engine.sampling_params import SamplingParams
from services.worker.engine_client import EngineClient
from tests.waiting import eventually
from tests.harness import sim_config
from tests.worker.test_engine_core import with_core as run_with_core

PROMPT = list(range(1, 41))            # 40 tokens: 3 blocks of 16
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
GIVE_UP_S = 0.3                        # how long a caller waits before it gives up
DEADLINE_S = 30.0


@contextmanager
def stopped(client: EngineClient):
    os.kill(client.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(client.pid, signal.SIGCONT)


def with_core(model_dir, scenario):
    """`scenario(client)` against a started core with a small cache; the core always stops."""
    return run_with_core(engine_config(str(model_dir), kv_cache_mib=8, sim=sim_config(8)), scenario)


async def blocks_taken(client: EngineClient) -> int:
    s = await client.stats()
    return s.kv_blocks_used + s.kv_blocks_reserved


async def past(deadline_s: float) -> None:
    """Until the monotonic clock is past `deadline_s` (a fact to wait for, not a guess)."""
    while time.monotonic() <= deadline_s:
        await asyncio.sleep(0.01)


def test_a_reserve_the_core_runs_after_its_caller_gave_up_is_cancelled(tiny_model_dir):
    async def scenario(client: EngineClient):
        told = []
        with stopped(client):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.reserve(
                    "late-1", PROMPT, PARAMS, None, None,
                    abandoned=lambda rid, how: told.append((rid, how))), GIVE_UP_S)
        assert await eventually(lambda: told, DEADLINE_S)
        assert await eventually(lambda: _zero(blocks_taken(client)), DEADLINE_S)
        return told

    assert with_core(tiny_model_dir, scenario) == [("late-1", "late")]


def test_a_reserve_reached_past_its_deadline_reserves_nothing(tiny_model_dir):
    async def scenario(client: EngineClient):
        told = []

        def tell(rid, how):
            told.append((rid, how))
        gone_deadline = time.monotonic() + GIVE_UP_S
        waiting_deadline = time.monotonic() + GIVE_UP_S
        with stopped(client):
            with pytest.raises(asyncio.TimeoutError):       # this caller gives up at its deadline
                await asyncio.wait_for(client.reserve("gone-1", PROMPT, PARAMS, None, None,
                                                      gone_deadline, tell), GIVE_UP_S)
            waiting = asyncio.create_task(client.reserve("waiting-1", PROMPT, PARAMS, None,
                                                         None, waiting_deadline, tell))
            await past(waiting_deadline)
        assert await asyncio.wait_for(waiting, DEADLINE_S) is None
        assert await eventually(lambda: len(told) == 2, DEADLINE_S)
        taken = await blocks_taken(client)
        in_time = await client.reserve("in-time-1", PROMPT, PARAMS, None, None,
                                       time.monotonic() + DEADLINE_S, tell)
        return told, taken, in_time

    told, taken, in_time = with_core(tiny_model_dir, scenario)
    assert sorted(told) == [("gone-1", "expired"), ("waiting-1", "expired")]
    assert taken == 0
    assert in_time and len(told) == 2                        # reserved, and nobody told


async def _zero(value) -> bool:
    return await value == 0
