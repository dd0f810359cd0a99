"""PacedTransport: the simulated core's KV transport. The real backend moves the blocks; each
write starts once the modelled time for the prompt's real bytes has passed."""
from __future__ import annotations

import asyncio

import pytest
import torch

from services.kv_transfer import KVTransferError, wait_done
from services.kv_transfer.paced import PacedTransport
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from tests.kv_transfer.helpers import DST, SRC, Pair, expected_target, new_id


def test_a_paced_write_moves_the_real_blocks_and_asks_the_model_for_the_prompts_tokens():
    pair, asked = Pair("tcp"), []
    try:
        before = pair.refill(seed=3)
        source = PacedTransport(pair.source, lambda n: asked.append(n) or 0.01)
        rid = new_id()
        target = pair.target.expect(rid, DST, timeout_s=30)
        handle = source.write(rid, SRC, pair.target.descriptor(DST), timeout_s=30,
                              hand_off=pb.HandOff(request_id=rid, first_token=5,
                                                  num_prompt_tokens=21))

        async def both():
            await wait_done(handle)
            await wait_done(target)
        asyncio.run(both())
        assert asked == [21]
        assert target.hand_off.first_token == 5
        assert torch.equal(pair.target_kv.data,
                           expected_target(before, pair.source_kv.data, SRC, DST))
    finally:
        pair.close()


def test_a_write_whose_modelled_time_outlasts_its_deadline_fails_and_writes_nothing():
    pair = Pair("tcp")
    try:
        before = pair.refill(seed=4)
        source = PacedTransport(pair.source, lambda n: 3600.0)
        rid = new_id()
        handle = source.write(rid, SRC, pair.target.descriptor(DST), timeout_s=0.2)
        with pytest.raises(KVTransferError, match="timed out"):
            asyncio.run(wait_done(handle))
        source.close()                       # cancels the pending start
        assert torch.equal(pair.target_kv.data, before)
    finally:
        pair.close()
