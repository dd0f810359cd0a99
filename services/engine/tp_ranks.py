"""Tensor-parallel ranks as processes. Rank 0 is the engine's own process: it schedules, samples and
drives; ranks 1..N-1 are followers (`python -m services.engine.tp_ranks`) that run the same forward
on their shard of the model (services/engine/model/tensor_parallel.py) every step.

    rank 0 (LLMEngine)                                     rank r (follower)
    TPLeader.start(N): spawn, FileStore rendezvous   ->    join the group (gloo on 127.0.0.1)
    leader.setup(Setup)                  stdin frame ->    load its shard, its KV cache (its part of
                                                           the shared KV file where there is one)
                                     <== barrier ==>   the follower's cache is mapped
    leader.copy_blocks(copies)           stdin frame ->    the same block copies (n > 1 forks)
    DrivingRunner.execute(chunks):
        leader.send_step(chunks)         stdin frame ->    ModelRunner.execute(chunks)
        ModelRunner.execute(chunks)  <== all-reduce / all-gather (gloo; NCCL on CUDA) ==>
    leader.close(): stdin closed                     ->    EOF: exit 0

Frames are a 4-byte little-endian length + msgpack (typed msgspec structs). Followers wait for work
on their stdin, never inside a collective, so an idle engine hits no collective timeout. The
rendezvous is a FileStore in a private temp dir (removed once every rank has joined) and gloo binds
127.0.0.1 only: nothing listens outside loopback. Devices (services/engine/device.py rank_device):
on the CPU every rank is on the CPU (gloo); on CUDA rank r is on cuda:r of the GPUs the engine's
process sees and selects it before joining (NCCL), so N ranks need N GPUs. Each rank's KV cache
holds only its KV heads; the block pool is rank 0's and the block ids in each Step are the same
for every rank. In a worker on the CPU the N caches are the N rank-major parts of one shared
file (drive(), services/kv_transfer/base.py KVLayout), so the worker's KV transfer ships rank r's
part of a block to the other worker's rank r.

Failure: rank 0 gone -> followers read EOF (or their collective fails) and exit. A follower gone ->
rank 0's next frame or collective raises TPRankFailed naming the rank and its exit status (and the
worker's engine core also watches the followers' pidfds while idle: services/worker/engine_core.py).
"""
from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import msgspec
import torch
import torch.distributed as dist

from services.engine.device import rank_device
from services.engine.model.batch import SeqChunk
from services.engine.model.kv_cache import KVCache, kv_cache_shape
from services.engine.model.config import ModelConfig
from services.engine.model.loader import load_model
from services.engine.model.runner import ModelRunner
from services.engine.model.tensor_parallel import TensorParallelLlama, TPGroup, check_shardable

from services.protocol import env

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0          # followers import torch and reach the rendezvous
COLLECTIVE_TIMEOUT_S = 600.0    # one collective: a slow step on a loaded host, not idle time
EXIT_GRACE_S = 5.0
STORE_FILE = "store"


class TPRankFailed(RuntimeError):
    """A tensor-parallel follower rank died or failed: the engine cannot step any more."""


class Setup(msgspec.Struct, tag=1, array_like=True):
    model_dir: str
    dtype: str                     # the model's (load_model's dtype argument)
    num_blocks: int                # the KV cache's, as rank 0's
    block_size: int
    kv_dtype: str                  # torch dtype name, e.g. float32, float8_e4m3fn
    kv_scales: list[float]         # (k_scale, v_scale): fp8's per-tensor scales, else 1.0
    attention_backend: str         # EngineConfig.attention_backend (auto | torch | triton)
    kv_path: str = ""              # the shared KV file of every rank (drive()); "": own memory


class Step(msgspec.Struct, tag=2, array_like=True):
    # (token_ids, start_pos, block_table, logit_rows) per SeqChunk, in the batch's order
    chunks: list[tuple[list[int], int, list[int], list[int]]]


class CopyBlocks(msgspec.Struct, tag=3, array_like=True):
    # (src, dst) block pairs, applied in order: rank 0 copied the same blocks in its own cache
    # (a forked sample's copy-on-write of its prompt's partial last block, n > 1)
    copies: list[tuple[int, int]]


Frame = Setup | Step | CopyBlocks
ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(Frame)


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def join(rank: int, world_size: int, store: dist.Store, backend: str = "gloo") -> TPGroup:
    """Join the default process group over `store`; gloo pairs bind to 127.0.0.1. One store
    instance per process: a FileStore removes its file once world_size instances are gone."""
    store.set(f"joined/{rank}", "1")
    options = None
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                            pg_options=options)
    dist.barrier()      # every rank is past its rendezvous: rank 0 may remove the store's file
    return TPGroup(rank, world_size)


# ---------------------------------------------------------------------------------- rank 0
class TPLeader:
    """Rank 0's handle on its followers: spawn, rendezvous, frames, liveness, shutdown."""

    def __init__(self, world_size: int, procs: list[subprocess.Popen], run_dir: str, tp: TPGroup):
        self.world_size = world_size
        self.procs = procs             # procs[i] is rank i + 1
        self.run_dir = run_dir
        self.tp = tp
        self.closed = False

    @classmethod
    def start(cls, world_size: int, threads: int = 0, backend: str = "gloo",
              device_kind: str = "cpu") -> TPLeader:
        """device_kind: cpu | cuda, where every rank runs (rank r on rank_device(kind, r))."""
        if world_size < 2:
            raise ValueError(f"a tensor-parallel leader needs world size >= 2, got {world_size}")
        if dist.is_initialized():
            raise RuntimeError("this process is already in a torch.distributed group "
                               "(one tensor-parallel engine per process)")
        run_dir = tempfile.mkdtemp(prefix="kvfleet-tp-")
        store_path = os.path.join(run_dir, STORE_FILE)
        threads = threads or torch.get_num_threads()
        procs = [subprocess.Popen(
            [sys.executable, "-m", "services.engine.tp_ranks", str(rank), str(world_size), store_path,
             "--threads", str(threads), "--backend", backend, "--device", device_kind],
            stdin=subprocess.PIPE, stdout=2, env=_follower_env())   # stdout: ours is data
            for rank in range(1, world_size)]
        leader = cls(world_size, procs, run_dir, TPGroup(0, world_size))
        try:
            store = dist.FileStore(store_path, world_size)
            leader._wait_for_followers(store)
            join(0, world_size, store, backend)
            shutil.rmtree(run_dir, ignore_errors=True)   # no rank reads the store again
        except BaseException:
            leader.close()
            raise
        return leader

    def _wait_for_followers(self, store: dist.Store) -> None:
        """Until every follower has reached the rendezvous; TPRankFailed if one dies first."""
        keys = [f"joined/{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TPRankFailed(f"tensor-parallel followers did not join within {JOIN_TIMEOUT_S:g} s")
            time.sleep(0.05)

    def setup(self, setup: Setup) -> None:
        self._send(setup)

    def send_step(self, chunks: Sequence[SeqChunk]) -> None:
        self._send(Step([(list(c.token_ids), int(c.start_pos), list(c.block_table), list(c.logit_rows))
                         for c in chunks]))

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        self._send(CopyBlocks([(int(src), int(dst)) for src, dst in copies]))

    def _send(self, frame: Frame) -> None:
        blob = ENCODER.encode(frame)
        data = struct.pack("<I", len(blob)) + blob
        for proc in self.procs:
            try:
                proc.stdin.write(data)
                proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                self.check_alive()
                raise TPRankFailed(f"tensor-parallel rank {self.rank_of(proc)} (pid {proc.pid}) "
                                   f"closed its input") from None

    def rank_of(self, proc: subprocess.Popen) -> int:
        return self.procs.index(proc) + 1

    def dead(self, wait_s: float = 0.0) -> str | None:
        """A description of the first follower that has exited, or None while all run. wait_s:
        give a dying one that long to be reaped (its sockets close a moment before it exits)."""
        for proc in self.procs:
            try:
                code = proc.wait(wait_s) if wait_s else proc.poll()
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
                return f"tensor-parallel rank {self.rank_of(proc)} (pid {proc.pid}) {how}"
        return None

    def check_alive(self) -> None:
        message = self.dead()
        if message is not None:
            raise TPRankFailed(message)

    def close(self) -> None:
        """Stop the followers (EOF on stdin; SIGKILL past EXIT_GRACE_S) and leave the group."""
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank %d (pid %d) did not exit; killing it",
                            self.rank_of(proc), proc.pid)
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self.run_dir, ignore_errors=True)


class DrivingRunner:
    """Rank 0's ModelRunner: each execute() first sends the step to the followers, then runs the
    same forward with them. Everything else (kv_cache, model, last_prepare_s) is the runner's."""

    def __init__(self, runner: ModelRunner, leader: TPLeader):
        self.runner = runner
        self.leader = leader

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        if chunks:
            self.leader.send_step(chunks)
        try:
            return self.runner.execute(chunks)
        except RuntimeError as e:               # a collective whose peer is gone
            message = self.leader.dead(wait_s=1.0)
            if message is not None:
                raise TPRankFailed(message) from e
            raise


def start_rank0(model_dir: str, dtype: str, world_size: int,
                device: torch.device | str = "cpu") -> tuple[TensorParallelLlama, TPLeader]:
    """Rank 0's start (LLMEngine): check the model shards, start the followers, load rank 0's
    shard (only its slices of the checkpoint are read; the followers read theirs)."""
    check_shardable(ModelConfig.from_dir(model_dir), world_size)
    device = torch.device(device)
    if device != rank_device(device.type, 0):
        raise ValueError(f"tensor-parallel rank 0 runs on {rank_device(device.type, 0)}, not {device}")
    select(device)
    leader = TPLeader.start(world_size, backend=backend_for(device), device_kind=device.type)
    try:
        return load_model(model_dir, dtype=dtype, device=device, tp=leader.tp), leader
    except BaseException:
        leader.close()
        raise


def drive(runner: ModelRunner, leader: TPLeader, model_dir: str, config, kv_path: str = "") -> DrivingRunner:
    """The followers build the same runner: the model in config.dtype, their own shard, the same
    attention backend, a KV cache like rank 0's (blocks, block size, element type, fp8 scales)
    over their own KV heads; -> rank 0's runner that drives them. config: the EngineConfig.
    kv_path: the shared file holding every rank's cache, rank-major (rank r's is the r-th of N
    equal parts), which each follower maps; "" for each its own memory. Returns once every
    follower has built its runner (and so mapped the file: its creator may unlink it then)."""
    kv = runner.kv_cache
    leader.setup(Setup(str(model_dir), config.dtype, kv.num_blocks, kv.block_size,
                       str(kv.dtype).removeprefix("torch."),
                       [getattr(kv, "k_scale", 1.0), getattr(kv, "v_scale", 1.0)],
                       config.attention_backend, kv_path))
    try:
        dist.barrier()
    except RuntimeError as e:                   # a follower failed to load or map: it is gone
        raise TPRankFailed(leader.dead(wait_s=1.0) or f"a tensor-parallel rank failed: {e}") from e
    return DrivingRunner(runner, leader)


# -------------------------------------------------------------------------------- followers
def _follower_env() -> dict[str, str]:
    """This environment with this checkout importable; NCCL kept on loopback."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = env.PYTHONPATH.get()
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else ""),
            "NCCL_SOCKET_IFNAME": "lo"}


def _read_frame(fd: int) -> Frame | None:
    """The next frame, or None at EOF (rank 0 is gone or closed us)."""
    head = _read_exactly(fd, 4)
    if head is None:
        return None
    body = _read_exactly(fd, struct.unpack("<I", head)[0])
    if body is None:
        return None
    return DECODER.decode(body)


def _read_exactly(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def select(device: torch.device) -> None:
    """Make `device` this process's current GPU (NCCL's communicator binds to it); a CPU rank has
    nothing to select."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def follow(tp: TPGroup, fd: int, device: torch.device | None = None) -> None:
    """A follower's life after joining: Setup, then one forward per Step until EOF. device: this
    rank's (rank_device), the CPU by default."""
    device = device or torch.device("cpu")
    setup = _read_frame(fd)
    if setup is None:
        return
    if not isinstance(setup, Setup):
        raise RuntimeError(f"tensor-parallel rank {tp.rank}: expected Setup first, got {type(setup).__name__}")
    if setup.kv_path and device.type != "cpu":
        raise ValueError(f"tensor-parallel rank {tp.rank} on {device}: a shared KV file is host "
                         "memory; a GPU rank keeps its cache in its own device memory")
    model = load_model(setup.model_dir, dtype=setup.dtype, device=device, tp=tp)
    shape = kv_cache_shape(model.config, setup.num_blocks, setup.block_size)
    dtype = getattr(torch, setup.kv_dtype)
    if setup.kv_path:
        data = shared_rank_kv(setup.kv_path, shape, dtype, tp)
    else:
        data = torch.zeros(shape, dtype=dtype, device=model.device)
    scaled = setup.kv_scales != [1.0, 1.0]
    kv_cache = KVCache.over(data, *setup.kv_scales) if scaled else KVCache.over(data)
    runner = ModelRunner(model, kv_cache, backend=setup.attention_backend)
    dist.barrier()                      # rank 0's drive(): this rank's cache is mapped
    while (frame := _read_frame(fd)) is not None:
        if isinstance(frame, CopyBlocks):
            for src, dst in frame.copies:
                kv_cache.write_blocks([dst], kv_cache.read_blocks([src]))
        else:
            runner.execute([SeqChunk(*chunk) for chunk in frame.chunks])


def shared_rank_kv(path: str, rank_shape: tuple[int, ...], dtype: torch.dtype, tp: TPGroup) -> torch.Tensor:
    """Rank tp.rank's cache inside the shared file of all N: [N * num_layers, ...] rank-major."""
    size = math.prod(rank_shape)
    data = torch.from_file(path, shared=True, size=size * tp.world_size, dtype=dtype)
    return data[tp.rank * size:(tp.rank + 1) * size].view(rank_shape)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.engine.tp_ranks")
    p.add_argument("rank", type=int)
    p.add_argument("world_size", type=int)
    p.add_argument("store_path")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where every rank runs: this one on rank_device(DEVICE, rank)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s tp-rank-{args.rank} %(levelname)s %(message)s")
    import signal  # noqa: PLC0415
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C: rank 0 decides and closes us
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = rank_device(args.device, args.rank)
        select(device)                  # before joining: NCCL binds to the current GPU
        tp = join(args.rank, args.world_size, dist.FileStore(args.store_path, args.world_size), args.backend)
        follow(tp, sys.stdin.fileno(), device)
    except BaseException:  # noqa: BLE001 - a follower failure is reported, never silent
        log.critical("tensor-parallel rank %d failed", args.rank, exc_info=True)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)                    # no interpreter teardown (torch's can take a while)
