"""KVLayout, make_transport and the handle's contract, backend-independent."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.kv_transfer import KVLayout, KVTransferError, make_transport, wait_done
from services.kv_transfer.base import Completion
from services.kv_transfer.peer import make_cache
from tests.kv_transfer.helpers import LAYOUT


def test_layout_is_read_off_the_pool_and_round_trips_through_its_message():
    layout = KVLayout.of(make_cache(LAYOUT, 5))
    assert layout == LAYOUT  # num_blocks is not part of it
    assert layout.to_pb() == pb.KVLayout(num_layers=3, block_size=4, kv_heads=2, head_dim=8, dtype="float32",
                                         tensor_parallel_size=1, k_scale=1.0, v_scale=1.0)
    assert KVLayout.from_pb(pb.KVLayout.FromString(layout.to_pb().SerializeToString())) == layout
    assert layout.region_bytes == 4 * 2 * 8 * 4
    assert layout.bytes_per_block == 3 * 2 * layout.region_bytes == make_cache(LAYOUT, 5).bytes_per_block


@pytest.mark.parametrize("message, why", [
    (pb.KVLayout(), "every size must be at least 1"),
    (pb.KVLayout(num_layers=3, block_size=4, kv_heads=0, head_dim=8, dtype="float32"), "at least 1"),
    (pb.KVLayout(num_layers=3, block_size=4, kv_heads=2, head_dim=8, dtype="int8"), "unsupported dtype 'int8'"),
    (pb.KVLayout(num_layers=3, block_size=4, kv_heads=2, head_dim=8), "unsupported dtype ''"),
])
def test_a_bad_layout_message_is_refused_with_the_reason(message, why):
    with pytest.raises(ValueError, match=f"bad KV layout .*{why}"):
        KVLayout.from_pb(message)


def test_unknown_backend_names_the_ones_that_exist():
    with pytest.raises(ValueError, match="nixl, tcp, local"):
        make_transport("rdma", "w0")


def test_a_handle_fails_at_its_deadline_and_wait_gives_up_without_failing_it():
    handle = Completion("transfer 'a'", timeout_s=0.3)
    with pytest.raises(KVTransferError, match="still running after wait"):
        handle.wait(0.01)
    assert not handle.done()
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="timed out after 0.3s"):
        handle.wait(10.0)
    assert time.monotonic() - start < 1.0
    assert handle.done() and not handle.finish()  # the first outcome stays


def test_a_handle_finished_from_another_thread_wakes_its_waiter():
    handle = Completion("transfer 'b'", timeout_s=10.0)
    threading.Timer(0.05, handle.finish).start()
    handle.wait(5.0)
    assert handle.done()


def test_the_hand_off_is_kept_only_by_a_handle_that_succeeded():
    hand_off = pb.HandOff(request_id="r", first_token=7, num_prompt_tokens=12)
    landed, failed = Completion("a", 10.0), Completion("b", 10.0)
    landed.finish(None, hand_off)
    failed.finish("peer gone", hand_off)
    assert landed.hand_off == hand_off and failed.hand_off is None


def test_finish_waits_for_a_chunk_being_written_and_none_starts_after():
    handle = Completion("transfer 'c'", timeout_s=10.0)
    copying, finished = threading.Event(), threading.Event()

    def finisher():
        copying.wait(5.0)
        handle.finish("cancelled by the receiver")
        finished.set()

    threading.Thread(target=finisher).start()
    with handle.writing() as still_open:
        assert still_open
        copying.set()
        assert not finished.wait(0.05)  # finish() is held off while the chunk is copied
    assert finished.wait(5.0)
    with handle.writing() as still_open:
        assert not still_open


# ---- wait_done: the asyncio side; no thread waits, the loop is woken ------------------------------------

def test_wait_done_resolves_when_another_thread_finishes_the_handle():
    async def main():
        handle = Completion("transfer 'd'", timeout_s=10.0)
        threading.Timer(0.05, handle.finish, kwargs={"hand_off": pb.HandOff(first_token=3)}).start()
        threads = threading.active_count()
        await asyncio.wait_for(wait_done(handle), 5.0)
        assert threading.active_count() <= threads  # no waiter thread was started for it
        return handle.hand_off.first_token

    assert asyncio.run(main()) == 3


def test_wait_done_raises_the_handles_error():
    async def main():
        handle = Completion("transfer 'e'", timeout_s=10.0)
        asyncio.get_running_loop().call_later(0.02, handle.finish, "transfer 'e': peer gone")
        await asyncio.wait_for(wait_done(handle), 5.0)

    with pytest.raises(KVTransferError, match="peer gone"):
        asyncio.run(main())


@pytest.mark.serial                     # a claim about time: run alone after the parallel run
def test_wait_done_fails_at_the_deadline_with_nobody_calling_done():
    async def main():
        handle = Completion("transfer 'f'", timeout_s=0.2)
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="timed out after 0.2s"):
            await asyncio.wait_for(wait_done(handle), 5.0)
        return time.monotonic() - start, handle

    elapsed, handle = asyncio.run(main())
    assert 0.15 < elapsed < 1.0 and handle.done() and handle.error


def test_wait_done_on_a_finished_handle_returns_at_once_and_a_cancelled_wait_leaves_nothing_behind():
    async def main():
        done = Completion("transfer 'g'", timeout_s=10.0)
        done.finish()
        await asyncio.wait_for(wait_done(done), 1.0)
        pending = Completion("transfer 'h'", timeout_s=10.0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(wait_done(pending), 0.05)
        assert not pending._callbacks and not pending.done()

    asyncio.run(main())
