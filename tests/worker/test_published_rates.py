"""A cold worker's heartbeat already carries what the router predicts with: real prefill and
decode worker processes and a real redis-server; their first records in Redis have a non-zero
prefill cost (their prior, measured at start, nothing fitted yet) and the KV bytes a token."""
from __future__ import annotations

import pytest

import asyncio

from tests.waiting import wait_until
from services.state.fleet_state import FleetState
from tests.harness import running_fleet


def records(redis_url: str) -> dict:
    async def read():
        state = FleetState(redis_url)
        try:
            return {w.worker_id: w for w in await state.live_workers()}
        finally:
            await state.close()
    return asyncio.run(read())


@pytest.mark.real_model("the real CPU engine's measured prior and the tiny model's KV bytes per "
                        "token (a simulated worker publishes its own step timer's prior)")
def test_a_cold_workers_first_record_carries_its_prior(redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", routers=0,
                       engine="real") as fleet:
        assert wait_until(lambda: {"prefill-0", "decode-0"} <= records(fleet.redis_url).keys(), 60)
        first = records(fleet.redis_url)
    prefill = first["prefill-0"]
    assert prefill.prefill_fit_steps == 0                        # nothing measured yet
    assert prefill.prefill_step_s > 0 and prefill.prefill_s_per_token > 0
    assert (prefill.prefill_step_s, prefill.prefill_s_per_token) == pytest.approx(
        (prefill.prior_step_s, prefill.prior_s_per_token), rel=1e-9)   # the fit's scaling
    assert prefill.prior_source.startswith("measured-at-start: ")   # its warm-up profile
    assert prefill.prefill_drain_tokens_per_s > 0 and prefill.token_budget > 0
    assert prefill.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4      # K+V, 4 layers, 2 heads of 32, fp32
    assert first["decode-0"].kv_bytes_per_token == prefill.kv_bytes_per_token
