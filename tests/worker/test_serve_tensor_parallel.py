"""A worker served with `--tensor-parallel 2`: the engine core is rank 0 and starts one follower
rank process. It answers a request with the unsharded engine's greedy tokens (with an fp8 KV cache
and non-default scales: the follower's cache is made like rank 0's); when the follower dies, the
worker fails visibly (ENGINE_FAILED_EXIT, the rank named) for its supervisor to restart, and no
process of it is left."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import grpc

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.sampling_params import SamplingParams
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.worker.serve import ENGINE_FAILED_EXIT

PROMPT = [5, 6, 7, 8, 9, 10, 11]
MAX_TOKENS = 6
START_DEADLINE_S = 180.0


def test_a_tp2_worker_with_an_fp8_cache_answers_like_tp1_and_fails_visibly_when_a_rank_dies(tiny_model_dir, tmp_path):
    stderr = open(tmp_path / "worker.stderr", "w+")
    worker = subprocess.Popen(
        [sys.executable, "-m", "services.cli.cli", "serve", "mixed", "--model", str(tiny_model_dir),
         "--kv-cache-mib", "16", "--insecure-internal", "--threads", "1", "--tensor-parallel", "2",
         "--kv-cache-dtype", "fp8", "--kv-cache-scales", "0.5,0.25"],
        stdout=subprocess.PIPE, stderr=stderr)
    pids = [worker.pid]
    try:
        address = _ready_address(worker, stderr)
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
    finally:
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        worker.wait(10)
        stderr.close()


def _ready_address(worker: subprocess.Popen, stderr) -> str:
    """host:port from the READY line (other announcement lines may come first). Reads the pipe
    unbuffered: a buffered readline could hold READY while select() waits on an empty pipe."""
    deadline, out = time.monotonic() + START_DEADLINE_S, b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([worker.stdout], [], [], deadline - time.monotonic())
        data = os.read(worker.stdout.fileno(), 4096) if ready else b""
        assert data, f"the worker ended or never said READY:\n{_tail(stderr)}"
        out += data
        for line in out.decode().split("\n")[:-1]:          # whole lines only
            if line.startswith("READY "):
                return line.split()[2]
    raise AssertionError(f"no READY within {START_DEADLINE_S:g} s:\n{_tail(stderr)}")


def _child(parent: int, marker: bytes) -> int:
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if ppid == parent and marker in cmdline:
            return int(entry)
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
