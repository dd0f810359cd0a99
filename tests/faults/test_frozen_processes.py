"""A frozen process (SIGSTOP, then SIGCONT) holds no client past a deadline, and leaves the fleet.

A real disaggregated fleet per test (workers, a router, the gateway's FleetRun; real redis-server),
two prefill workers so that the plan has a fallback. Every wait has a deadline; no timing is
asserted (docs/benchmarks.md has the measured failover).

  - a frozen prefill worker: a request the plan sends to it is accepted by no one within
    prefill_start_s and fails over to the plan's fallback prefill worker;
  - a frozen engine core (the prefill's, then the decode's): its worker answers Health
    NOT_SERVING and leaves the router's live list (its Redis record expires) within
    engine_stall_s and a beat, a request sent meanwhile completes on the other workers, and once
    the core runs again the worker is back.
"""
from __future__ import annotations

import asyncio
import os
import signal
from contextlib import contextmanager


from tests.waiting import wait_until
from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.timeouts import Timeouts
from services.state.fleet_state import FleetState
from tests.harness import Fleet, engine_core_pid, route_request, running_fleet

PROMPT = list(range(1, 25))
START_S = 2.0                      # prefill_start_s in these fleets
STALL_S = 2.0                      # engine_stall_s in the engine-core fleets


@contextmanager
def frozen(pid: int):
    """`pid` stopped (SIGSTOP) inside the block, continued (SIGCONT) on the way out."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


def engine_core(fleet: Fleet, worker: str) -> int:
    """The pid of `worker`'s engine core process."""
    return engine_core_pid(fleet.launcher.children[worker].proc.pid)


def health(fleet: Fleet, worker: str) -> int:
    with fleet.channel(fleet.workers[worker]) as ch:
        return pb_grpc.WorkerStub(ch).Health(pb.HealthRequest(), timeout=5).status


def live(fleet: Fleet) -> set[str]:
    """The workers whose Redis record is live (what the router places on)."""
    async def read() -> set[str]:
        async with FleetState(fleet.redis_url) as state:
            return {w.worker_id for w in await state.live_workers()}
    return asyncio.run(read())


def served(chunks: list[pb.TokenChunk], tokens: int) -> bool:
    return bool(chunks) and chunks[-1].finished and sum(len(c.token_ids) for c in chunks) == tokens


def test_a_request_on_a_frozen_prefill_worker_fails_over_to_the_plans_fallback(
        redis_url, tiny_model_dir):
    # a long heartbeat TTL keeps the frozen prefill-0 listed, and it is the router's first choice
    # (equal cost, lowest id): the plan names it first, and only its start deadline moves it on
    keep_listed = ("--timeout-heartbeat-ttl-s", "20", "--timeout-engine-stall-s", "20")
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", prefill=2, decode=1,
                       worker_args=keep_listed) as fleet:
        fleet.timeouts = Timeouts(prefill_start_s=START_S)
        assert wait_until(lambda: len(live(fleet)) == 3, 30)
        with frozen(fleet.launcher.children["prefill-0"].proc.pid):
            call = fleet.generate(route_request("frozen-prefill", PROMPT, 6, ignore_eos=True))
            chunks = list(call)
        assert [w.worker_id for w in call.run.plan.prefill] == ["prefill-0", "prefill-1"]
        assert chunks[0].served_by == "prefill-1"
        assert served(chunks, 6)
        # thawed, the worker serves again (what it was sent was cancelled)
        again = list(fleet.generate(route_request("after", PROMPT, 4, ignore_eos=True)))
        assert served(again, 4)


def test_a_frozen_engine_core_takes_its_worker_out_until_it_runs_again(redis_url, tiny_model_dir):
    stall = ("--timeout-engine-stall-s", str(STALL_S))      # heartbeat 0.3 s, TTL 0.9 s
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", prefill=2, decode=2,
                       worker_args=stall) as fleet:
        fleet.timeouts = Timeouts(prefill_start_s=START_S)
        everyone = {"prefill-0", "prefill-1", "decode-0", "decode-1"}
        assert wait_until(lambda: live(fleet) == everyone, 30)
        for victim in ("prefill-0", "decode-0"):
            with frozen(engine_core(fleet, victim)):
                # sent at once, while the router may still place on the victim: it completes
                # (the prefill's fallback, or the other decode worker) or fails fast and typed
                try:
                    during = list(fleet.generate(route_request(f"during-{victim}", PROMPT, 4,
                                                               ignore_eos=True)))
                    assert served(during, 4)
                except status.CallFailed as e:
                    assert e.status.reason in (pb.UNAVAILABLE, pb.OVERLOADED), e.status
                assert wait_until(lambda: health(fleet, victim) ==
                                  pb.HealthResponse.NOT_SERVING, STALL_S + 10)
                assert wait_until(lambda: victim not in live(fleet), STALL_S + 10)
                chunks = list(fleet.generate(route_request(f"meanwhile-{victim}", PROMPT, 4,
                                                           ignore_eos=True)))
                assert served(chunks, 4)
                assert victim not in {c.served_by for c in chunks}
            assert wait_until(lambda: health(fleet, victim) == pb.HealthResponse.SERVING, 20)
            assert wait_until(lambda: live(fleet) == everyone, 20)
