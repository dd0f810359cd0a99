"""A burst spreads over the decode replicas: 16 streams admitted at once (within one heartbeat) by two
routers over two decode workers split about evenly, so that losing one worker would not end them all.
Each router counts its own placements since the workers' beat and reads its peer's from Redis."""
from __future__ import annotations

import asyncio
from collections import Counter

from tests.waiting import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from tests.harness import route_request, running_fleet

PROMPT = list(range(300, 340))
STREAMS = 16


def test_sixteen_concurrent_streams_split_over_two_decode_workers(redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", decode=2, routers=2) as fleet:
        def both_decode_workers_live() -> bool:
            health = fleet.router_stub().Health(pb.HealthRequest())
            return health.status == pb.HealthResponse.SERVING and all(
                f"decode-{i}" in health.detail for i in range(2))
        assert wait_until(both_decode_workers_live, 60)
        calls = [fleet.generate(route_request(f"burst-{i}", PROMPT, 8, ignore_eos=True))
                 for i in range(STREAMS)]

        async def admit_all():
            return await asyncio.gather(*(c.run.start() for c in calls))
        plans = fleet._loop.run(admit_all())
        per_worker = Counter(plan.decode.worker_id for plan in plans)
        endings = [[chunk.finish_reason for chunk in call][-1] for call in calls]

        assert endings == ["length"] * STREAMS
        assert set(per_worker) == {"decode-0", "decode-1"}
        assert all(5 <= n <= 11 for n in per_worker.values()), per_worker
        assert {plan.router_id for plan in plans} == {"router", "router-1"}
