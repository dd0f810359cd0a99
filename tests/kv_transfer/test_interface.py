"""KVLayout, make_transport and the handle's contract, backend-independent."""
from __future__ import annotations

import threading
import time

import pytest

from services.kv_transfer import KVLayout, KVTransferError, make_transport
from services.kv_transfer.base import Completion
from services.kv_transfer.peer import make_cache
from tests.kv_transfer.helpers import LAYOUT


def test_layout_is_read_off_the_pool_and_round_trips_through_its_string():
    layout = KVLayout.of(make_cache(LAYOUT, 5))
    assert layout == LAYOUT  # num_blocks is not part of it
    assert layout.encode() == "layers=3,kv=2,block=4,kv_heads=2,head_dim=8,dtype=float32"
    assert KVLayout.decode(layout.encode()) == layout
    assert layout.region_bytes == 4 * 2 * 8 * 4
    assert layout.bytes_per_block == 3 * 2 * layout.region_bytes == make_cache(LAYOUT, 5).bytes_per_block


@pytest.mark.parametrize("text", ["", "layers=3", "layers=3,kv=1,block=4,kv_heads=2,head_dim=8,dtype=float32",
                                  "layers=x,kv=2,block=4,kv_heads=2,head_dim=8,dtype=float32",
                                  "layers=3,kv=2,block=4,kv_heads=2,head_dim=8,dtype=int8"])
def test_a_bad_layout_string_is_refused(text):
    with pytest.raises(ValueError, match="bad KV layout"):
        KVLayout.decode(text)


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
