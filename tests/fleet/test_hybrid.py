"""A hybrid fleet (one mixed worker beside a prefill and a decode worker, the routers splitting at 64
prompt tokens): a short chat is planned co-located on the mixed worker, a long prompt disaggregated
from the prefill to the decode worker, and both stream to their end. When the mixed worker dies, the
fleet stays serving and the next short chat goes the disaggregated way."""
from __future__ import annotations

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from tests.harness import route_request, running_fleet
from tests.waiting import wait_until

SHORT = list(range(300, 340))       # 40 tokens: at most the split
LONG = list(range(300, 500))        # 200 tokens: past it


def run_to_end(fleet, rid: str, prompt: list[int]) -> tuple[pb.Plan, str]:
    """The plan a request got and how it ended."""
    call = fleet.generate(route_request(rid, prompt, 6, ignore_eos=True))
    plan = fleet._loop.run(call.run.start())
    return plan, [chunk.finish_reason for chunk in call][-1]


def live_roles(fleet) -> set[str]:
    detail = fleet.router_stub().Health(pb.HealthRequest()).detail
    return {role for role in ("mixed", "prefill", "decode") if f"{role}-0" in detail}


def test_short_prompts_stay_colocated_long_ones_move_and_a_lost_path_is_covered(redis_url,
                                                                                 tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "hybrid",
                       hybrid_threshold_tokens=64) as fleet:
        assert wait_until(lambda: live_roles(fleet) == {"mixed", "prefill", "decode"}, 60)

        chat, chat_end = run_to_end(fleet, "chat-1", SHORT)
        assert chat.mode == pb.Plan.COLOCATED and chat.prefill[0].worker_id == "mixed-0"
        assert chat_end == "length"

        doc, doc_end = run_to_end(fleet, "doc-1", LONG)
        assert doc.mode == pb.Plan.DISAGGREGATED
        assert (doc.prefill[0].worker_id, doc.decode.worker_id) == ("prefill-0", "decode-0")
        assert doc_end == "length"

        fleet.launcher.kill("mixed-0")
        assert wait_until(lambda: live_roles(fleet) == {"prefill", "decode"}, 30)
        assert fleet.router_stub().Health(pb.HealthRequest()).status == pb.HealthResponse.SERVING
        chat, chat_end = run_to_end(fleet, "chat-2", SHORT)
        assert chat.mode == pb.Plan.DISAGGREGATED and chat.decode.worker_id == "decode-0"
        assert chat_end == "length"
