"""A draining worker's wait (services/worker/drain.py), on an injected clock and a scripted stats
sequence (a stand-in for the worker's own stats: the fleet story is tests/cli/test_rebalance_local.py)."""
from __future__ import annotations

import asyncio

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.worker import drain as drain_mod
from services.worker.drain import drain, holds_work


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scripted(clock: Clock, busy_until_s: float, log: list[str]):
    async def stats() -> pb.WorkerStats:
        clock.now += 0.5                 # each look at the engine is half a second later
        return pb.WorkerStats(num_running=1) if clock.now < busy_until_s else pb.WorkerStats()
    async def leave() -> None:
        log.append(f"left at {clock.now}")
    return stats, leave


def test_it_leaves_first_then_waits_for_its_work_and_a_quiet_spell(monkeypatch):
    monkeypatch.setattr(drain_mod, "POLL_S", 0)
    clock, log = Clock(), []
    stats, leave = scripted(clock, busy_until_s=5.0, log=log)
    assert asyncio.run(drain(stats, leave, clock=clock, quiet_s=2.0, limit_s=60))
    assert log == ["left at 0.0"]
    assert clock.now == 6.5              # last seen busy at 4.5 s, then 2 s quiet


def test_a_drain_that_never_empties_gives_up_at_its_limit(monkeypatch):
    monkeypatch.setattr(drain_mod, "POLL_S", 0)
    clock, log = Clock(), []
    stats, leave = scripted(clock, busy_until_s=1e9, log=log)
    assert not asyncio.run(drain(stats, leave, clock=clock, quiet_s=2.0, limit_s=10))
    assert clock.now <= 11.0


def test_reservations_and_writes_in_flight_are_work_too():
    assert not holds_work(pb.WorkerStats())
    for field in ("num_running", "num_queued", "kv_blocks_reserved", "kv_writes_in_flight",
                  "kv_blocks_held"):
        assert holds_work(pb.WorkerStats(**{field: 1})), field
