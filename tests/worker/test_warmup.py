"""A cold worker prices its steps at the pace it measured at start (services/engine/warmup.py,
rates.py `prior_from_steps`): a real engine core process and the worker's gRPC server on
127.0.0.1. Its first record already carries a measured prior, near what its first real steps
then take; a warm-up that cannot finish in its time falls back to the default prior, saying so
in the record and the log."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from services.cli.serve_cmd import role_named
from services.engine.engine import engine_config
from services.engine.scheduler import attention_pairs
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.worker.build import build_worker
from services.worker.config import WorkerConfig
from services.worker.rates import TINY
from tests.harness import in_process_worker

CHAT = 200
SANE = 4.0       # the prior's step time within this factor of the steps then measured


def chat(i: int) -> pb.WorkRequest:
    """A 200-token prompt of its own (no prefix shared with another), one output token: its
    one step is a 200-token chunk at position 0."""
    return pb.WorkRequest(request_id=f"chat-{i}", tenant="default", traffic_class="interactive",
                          prompt_token_ids=[(i * 31 + 7 * j) % 500 + 1 for j in range(CHAT)],
                          params=pb.SamplingParams(max_tokens=1))


@pytest.mark.real_model("the warm-up profile runs on the real engine only (a simulated core's "
                        "prior is its own step timer)")
def test_a_cold_workers_first_record_carries_the_pace_it_measured_at_start(tiny_model_dir):
    async def story():
        mixed = await in_process_worker(str(tiny_model_dir), "mixed", engine="real")
        try:
            first = await mixed.stub.Stats(pb.StatsRequest(), timeout=10)
            for i in range(8):
                [_ async for _ in mixed.stub.Generate(chat(i), timeout=30)]
            later = await mixed.stub.Stats(pb.StatsRequest(), timeout=10)
        finally:
            await mixed.close()
        assert first.prior_source.startswith("measured-at-start: ")
        assert first.prior_source.endswith("times x2")           # WorkerConfig.warmup_margin
        assert first.prefill_fit_steps == 0                       # nothing served yet
        assert min(first.prior_step_s, first.prior_s_per_token, first.prior_s_per_pair) >= 0
        assert first.prior_s_per_token > 0 and first.prior_step_s + first.prior_s_per_pair > 0
        assert (first.prefill_step_s, first.prefill_s_per_token) == pytest.approx(
            (first.prior_step_s, first.prior_s_per_token), rel=1e-9)
        predicted = (first.prior_step_s + first.prior_s_per_token * CHAT
                     + first.prior_s_per_pair * attention_pairs(0, CHAT))
        assert later.prefill_fit_steps >= 8
        measured = later.prefill_recent_step_s            # the last 8 of those 200-token steps
        assert measured / SANE <= predicted <= measured * SANE, (predicted, measured)
    asyncio.run(story())


@pytest.mark.real_model("the warm-up profile runs on the real engine only")
def test_a_warm_up_past_its_timeout_falls_back_to_the_default_prior_visibly(tiny_model_dir,
                                                                              caplog):
    async def story():
        config = WorkerConfig("mixed-0", "mixed", "tcp", warmup_timeout_s=1e-6,
                              engine=engine_config(str(tiny_model_dir), kv_cache_mib=8))
        worker = build_worker(config, role_named("mixed"))
        await worker.start()
        try:
            async with grpc.aio.insecure_channel(worker.address) as channel:
                return await pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
        finally:
            await worker.stop()
    with caplog.at_level(logging.WARNING, logger="services.worker.build"):
        stats = asyncio.run(story())
    assert stats.prior_source.startswith(TINY.source)
    assert stats.prior_source.endswith("warm-up failed: timed out after 1e-06 s")
    assert (stats.prior_step_s, stats.prior_s_per_token) == (TINY.step_s, TINY.s_per_token)
    assert "the warm-up profile gave no prior (timed out after 1e-06 s)" in caplog.text
