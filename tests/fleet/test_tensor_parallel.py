"""Tensor parallelism in a disaggregated fleet: a prefill worker and a decode worker, each the engine
core (rank 0) and one follower rank process, gloo on 127.0.0.1. Each worker's KV pool holds both
ranks' caches rank-major, so the prefill worker's KV transfer ships rank 0's part of each block to the
decode worker's rank 0 part and rank 1's to rank 1's. The greedy tokens equal the in-process TP 1
engine's. A decode worker of another tensor-parallel size is refused: its pool's layout names the
other size, the prefill worker writes nothing into it, and the request ends with an error naming
both sizes rather than with tokens from a misread cache."""
from __future__ import annotations

import grpc
import pytest

from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from tests.harness import route_request, running_fleet
from tests.waiting import wait_until

PROMPT = [4080, 39, 72, 311, 464, 68] + list(range(600, 640))   # 46 tokens: 3 blocks of 16
MAX_TOKENS = 8
TP2 = ("--tensor-parallel", "2")


def reference(model_dir: str) -> list[int]:
    engine = LLMEngine(engine_config(model_dir, kv_cache_mib=8))
    (out,) = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                      ignore_eos=True))
    return out.token_ids


def serving(fleet) -> bool:
    return fleet.router_stub().Health(pb.HealthRequest()).status == pb.HealthResponse.SERVING


def idle(fleet, *names) -> bool:
    return all(s.kv_blocks_used == 0 and s.kv_blocks_reserved == 0
               for s in (fleet.stats(n) for n in names))


@pytest.mark.real_model("the TP 2 fleet's tokens equal the TP 1 engine's greedy tokens")
def test_tp2_prefill_and_tp2_decode_give_the_tp1_greedy_tokens(redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", worker_args=TP2,
                       engine="real") as fleet:
        assert wait_until(lambda: serving(fleet), 30)
        chunks = list(fleet.generate(route_request("tp2", PROMPT, MAX_TOKENS, ignore_eos=True)))
        assert chunks[0].served_by == "prefill-0" and {c.served_by for c in chunks[1:]} == {"decode-0"}
        assert [t for c in chunks for t in c.token_ids] == reference(str(tiny_model_dir))
        assert wait_until(lambda: idle(fleet, "prefill-0", "decode-0"), 5.0)
