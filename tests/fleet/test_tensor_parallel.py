"""Tensor parallelism in a disaggregated fleet (`kvfleet up --tensor-parallel 2`): a prefill worker
and a decode worker, each the engine core (rank 0) and one follower rank process, gloo on 127.0.0.1. Each worker's KV pool holds both
ranks' caches rank-major, so the prefill worker's KV transfer ships rank 0's part of each block to the
decode worker's rank 0 part and rank 1's to rank 1's. The greedy tokens equal the in-process TP 1
engine's. A decode worker of another tensor-parallel size is refused: its pool's layout names the
other size, the prefill worker writes nothing into it, and the request ends with an error naming
both sizes rather than with tokens from a misread cache."""
from __future__ import annotations

import argparse

import grpc
import pytest

from services.cli.launcher import descendants
from services.cli.up import add_up_args, check_tensor_parallel
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from services.engine.tiny_model import make_tiny_model
from services.protocol import fleet_token, status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from tests.harness import holds_nothing, route_request, running_fleet, stats, up_fleet
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
def test_kvfleet_up_tensor_parallel_2_gives_the_tp1_greedy_tokens(tiny_model_dir):
    with up_fleet(tiny_model_dir, "--tensor-parallel", "2", engine="real",
                    token=fleet_token.generate()) as up:      # the test reads the workers' Stats
        assert up.workers.keys() == {"prefill-0", "decode-0"}
        for name in up.workers:            # each worker: its engine core and one follower rank
            assert _followers(up.pid(name)) == 1
        with grpc.insecure_channel(up.grpc) as channel:
            chunks = list(pb_grpc.GatewayStub(channel).Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=PROMPT),
                params=pb.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)), timeout=120))
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert [t for c in chunks for t in c.token_ids] == reference(str(tiny_model_dir))
        assert wait_until(lambda: holds_nothing(up), 30), [stats(up, name) for name in up.workers]


def test_kvfleet_up_refuses_a_size_that_does_not_divide_the_heads_before_starting(tmp_path):
    three_kv_heads = make_tiny_model(tmp_path / "three-kv-heads", layers=1, hidden=192, heads=6,
                                     kv_heads=3, intermediate=384)
    args = up_parser().parse_args(["--model", str(three_kv_heads), "--tensor-parallel", "2"])
    with pytest.raises(SystemExit, match=r"kvfleet up: --tensor-parallel: tensor parallel size 2 "
                                         r"must divide .* num_kv_heads 3 not divisible by 2"):
        check_tensor_parallel(args)
    sim = up_parser().parse_args(["--engine", "sim", "--tensor-parallel", "2"])
    with pytest.raises(SystemExit, match="--sim-tp"):
        check_tensor_parallel(sim)


@pytest.mark.real_model("a real TP 2 prefill worker and a TP 1 decode worker")
def test_a_decode_worker_of_another_tensor_parallel_size_is_refused_naming_both(
        redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", prefill=0, decode=0) as fleet:
        fleet.worker("prefill-0", "prefill", str(tiny_model_dir), extra_args=TP2, engine="real")
        fleet.worker("decode-0", "decode", str(tiny_model_dir), engine="real")
        assert wait_until(lambda: serving(fleet), 30)
        with pytest.raises(status.CallFailed) as error:     # converted once, at the typed stub
            list(fleet.generate(route_request("tp-mismatch", PROMPT, MAX_TOKENS, ignore_eos=True)))
        assert error.value.status.reason == pb.KV_TRANSFER_FAILED
        assert ("layout mismatch: tensor parallel size differs: source (prefill) has "
                "tensor_parallel_size 2" in error.value.status.message)
        assert "target (decode) has tensor_parallel_size 1" in error.value.status.message
        assert wait_until(lambda: idle(fleet, "prefill-0", "decode-0"), 5.0)


def up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfleet up")
    add_up_args(parser)
    return parser


def _followers(worker_pid: int) -> int:
    """Tensor-parallel follower ranks under a worker process (children of its engine core)."""
    return sum(b"services.engine.tp_ranks" in _cmdline(pid) for pid in descendants(worker_pid))


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:                                      # gone meanwhile
        return b""
