"""A worker served with `--tensor-parallel 2`: the engine core is rank 0 and starts one follower
rank process. It answers a request with the unsharded engine's greedy tokens (with an fp8 KV cache
and non-default scales: the follower's cache is made like rank 0's); when the follower dies, the
worker fails visibly (ENGINE_FAILED_EXIT, the rank named) for its supervisor to restart, and no
process of it is left."""
from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from services.cli.launcher import children
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.worker.serve import ENGINE_FAILED_EXIT
from tests.harness import worker_process

PROMPT = [5, 6, 7, 8, 9, 10, 11]
MAX_TOKENS = 6
START_DEADLINE_S = 180.0


@pytest.mark.real_model("tensor-parallel ranks answer with the unsharded engine's greedy tokens")
def test_a_tp2_worker_with_an_fp8_cache_answers_like_tp1_and_fails_visibly_when_a_rank_dies(tiny_model_dir, tmp_path):
    with open(tmp_path / "worker.stderr", "w+") as stderr, worker_process(
            tiny_model_dir, "mixed", "--kv-cache-mib", "16", "--tensor-parallel", "2",
            "--kv-cache-dtype", "fp8", "--kv-cache-scales", "0.5,0.25", stderr=stderr,
            ready_s=START_DEADLINE_S, engine="real") as (worker, address):
        pids = [worker.pid]
        core = _child(worker.pid, b"services.worker.engine_core")
        follower = _child(core, b"services.engine.tp_ranks")
        pids += [core, follower]

        with grpc.insecure_channel(address) as channel:
            chunks = list(pb_grpc.WorkerStub(channel).Generate(pb.WorkRequest(
                request_id="tp-1", tenant="default", traffic_class="interactive",
                prompt_token_ids=PROMPT, params=pb.SamplingParams(max_tokens=MAX_TOKENS)), timeout=60))
        served = [t for c in chunks for t in c.token_ids]
        assert chunks[-1].finished and not chunks[-1].error
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="fp8",
                                        kv_cache_scales=(0.5, 0.25)))
        (want,) = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        assert served == want.token_ids and len(served) == MAX_TOKENS

        os.kill(follower, signal.SIGKILL)
        assert worker.wait(30) == ENGINE_FAILED_EXIT, _tail(stderr)
        assert "tensor-parallel rank 1" in _tail(stderr) and "killed by signal 9" in _tail(stderr)
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, f"still running: {[p for p in pids if not _gone(p)]}"
            time.sleep(0.05)


def _child(parent: int, marker: bytes) -> int:
    for pid in children(parent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker in f.read():
                    return pid
        except OSError:                                  # gone meanwhile
            continue
    raise AssertionError(f"process {parent} has no child running {marker.decode()}")


def _gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped counts as gone)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _tail(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-4000:]
