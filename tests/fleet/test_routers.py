"""Several routers serve one fleet. Requests spread across them (round robin at the client, as
the gateway does) and every router places alike; killing a router mid-stream leaves the streams
in flight running to completion, since no router is on their path, while new requests go to the
routers that are left."""
from __future__ import annotations

import threading

from tests.waiting import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from tests.harness import route_request, running_fleet

PROMPT = list(range(200, 240))


def test_killing_a_router_mid_stream_leaves_streams_running_and_new_requests_use_the_other(
        redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", routers=2) as fleet:
        assert wait_until(lambda: fleet.router_stub().Health(pb.HealthRequest()).status ==
                          pb.HealthResponse.SERVING, 20)
        calls = [fleet.generate(route_request(f"spread-{i}", PROMPT, 300, ignore_eos=True))
                 for i in range(4)]
        streams = [iter(c) for c in calls]
        firsts = [next(s) for s in streams]                      # all four are admitted
        assert all(len(f.token_ids) == 1 for f in firsts)
        assert {c.run.plan.router_id for c in calls} == {"router", "router-1"}
        assert len({(c.run.plan.prefill[0].worker_id, c.run.plan.decode.worker_id)
                    for c in calls}) == 1                        # both decided alike

        fleet.launcher.kill("router")                            # mid-stream
        counts = [0] * len(streams)
        endings = [None] * len(streams)

        def drain(i: int) -> None:
            for chunk in streams[i]:
                counts[i] += len(chunk.token_ids)
                endings[i] = chunk.finish_reason or endings[i]
        threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(streams))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert endings == ["length"] * 4 and counts == [299] * 4   # + the first token each

        after = [fleet.generate(route_request(f"after-{i}", PROMPT, 4)) for i in range(3)]
        for call in after:
            chunks = list(call)
            assert chunks[-1].finish_reason == "length"
            assert call.run.plan.router_id == "router-1"
