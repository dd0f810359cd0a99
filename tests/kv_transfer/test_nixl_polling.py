"""The nixl target polls its agent fast only while someone waits for an expected transfer: a
decode worker holding a reservation through a long prefill must not take the GIL thousands of
times a second for nothing. The transfer still lands, waited for or not."""
from __future__ import annotations

import threading
import time

import pytest

from services.kv_transfer.base import KVTransferError
from tests.kv_transfer.helpers import DST, SRC, Pair, expected_target, new_id


@pytest.fixture
def pair():
    p = Pair("nixl")
    yield p
    p.close()


def seconds_per_poll(transport, polls: int, timeout_s: float = 10.0) -> float:
    """The mean interval between the transport poller's next `polls` + 1 asks for notifications."""
    agent = transport._agent
    stamps: list[float] = []
    counted = threading.Event()
    original = agent.get_new_notifs

    def counting():
        stamps.append(time.monotonic())
        if len(stamps) > polls:
            counted.set()
        return original()

    agent.get_new_notifs = counting
    try:
        assert counted.wait(timeout_s), f"{len(stamps)} polls in {timeout_s}s"
    finally:
        del agent.get_new_notifs  # the bound method again
    return (stamps[polls] - stamps[0]) / polls


def test_an_expected_transfer_is_polled_fast_only_once_someone_waits(pair):
    before = pair.refill(seed=5)
    tid = new_id()
    handle = pair.target.expect(tid, DST, timeout_s=30)
    idle = seconds_per_poll(pair.target, 5)                  # reserved, the prefill runs elsewhere
    with pytest.raises(KVTransferError, match="still running"):
        handle.wait(0.001)                                   # the subscription starts waiting
    hurried = seconds_per_poll(pair.target, 50)
    pair.source.write(tid, SRC, pair.target.descriptor(DST), timeout_s=30).wait(30)
    handle.wait(30)
    assert idle >= 0.01                                      # ~every 20 ms, not every 0.2 ms
    assert hurried <= idle / 5
    assert pair.target_kv.data.equal(expected_target(before, pair.source_kv.data, SRC, DST))


def test_after_a_waited_transfer_lands_the_next_expected_one_is_polled_slowly_again(pair):
    pair.refill(seed=6)
    first, second = new_id(), new_id()
    handle = pair.target.expect(first, DST, timeout_s=30)
    pair.source.write(first, SRC, pair.target.descriptor(DST), timeout_s=30)
    handle.wait(30)                                          # waited for, landed
    pair.target.expect(second, DST, timeout_s=30)            # the next reservation: no waiter yet
    assert seconds_per_poll(pair.target, 5) >= 0.01
