"""The engine core: the process that owns an LLMEngine and its step() loop (the vLLM v1 EngineCore
pattern). The worker's server process (gRPC, KV transfer, streaming) talks to it only by the typed
messages below, msgpack-encoded over two ZeroMQ IPC sockets in a private run directory:

    server PUSH --commands-->  core PULL      AddRequest, Reserve, StartDecode, Cancel, ... Shutdown
    server PULL <--replies---  core PUSH      Ready, StepOutputs, Done/Reserved/..., CallFailed, Failure

One PUSH/PULL pair each way keeps order: a command's reply is sent before any step that follows it,
so a request's acceptance always reaches the server before its first token.

Lifecycle (`python -m services.worker.engine_core RUN_DIR`, started by EngineClient):
  1. read the EngineConfig (msgpack, length-prefixed) from stdin, connect the sockets, build the
     engine with its KV cache in shared memory (`SharedKV`), install fault injection
     (services/worker/faults.py), run the real engine's warm-up profile (`warm_up`: a few
     steps of chosen shapes on dummy blocks, within --warmup-timeout; services/engine/warmup.py),
     send Ready (where the KV memory is, and what the warm-up measured).
  2. loop: run every queued command (each answered with its typed reply; a command that raises
     is answered with CallFailed and the core goes on), then step() while there is work, sending
     each step's outputs and its StepStats in ONE StepOutputs message (a step that ran the model
     sends one even without outputs); block on the sockets when idle. A simulated core
     (EngineConfig.sim: `build_engine` makes it, no weights are loaded) sleeps until the step's
     start + its modelled time before sending it (emulation on the wall clock).
  3. Shutdown -> exit 0. The server process gone (stdin, which the server keeps open and never
     writes to again, reaches EOF) -> remove the run directory the server could not, exit 0.
     Any exception out of step() or the loop -> Failure (type + text + traceback), exit 1.
     Tensor parallelism (EngineConfig.tensor_parallel_size N > 1): the engine is rank 0 and starts
     N - 1 follower rank processes (services/engine/tp_ranks.py); the loop also watches their
     pidfds, so a rank that dies, even while idle, is a Failure naming it. The core stops them on
     its way out (and they exit by themselves when it is gone).

KV memory: the core owns it. On the CPU it allocates the cache as a file in the run directory (on
/dev/shm where there is one) mapped MAP_SHARED; the server maps the same file (`SharedKV.attach`)
and unlinks it, so the memory lives exactly as long as the two mappings. On CUDA (EngineConfig.device)
the cache is allocated in the core's device memory and Ready carries its CUDA IPC handle
(`DeviceKV`): the server opens the same device memory, so the transports read and write the
blocks the core's model reads without a host copy of the pool. The KV transport backends run in the server and
write straight into the pages the core's model reads. Who may touch which blocks when is ordered by
the messages: the server writes a reservation's blocks before it sends StartDecode, and reads a
prefilled prompt's blocks after the step that sent its prefilled output (and before it cancels the request);
the socket round trip orders the memory accesses.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import shutil
import signal
import struct
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import zmq

from services.engine.config import EngineConfig
from services.engine.kv_array import ArrayKVCache
from services.engine.engine import EngineStats, LLMEngine, StepRecord
from services.engine.outputs import TokenOutput
from services.engine.sampling_params import SamplingParams
from services.engine.warmup import Profile
from services.worker import faults, step_trace

if TYPE_CHECKING:   # the model's cache; a simulated core imports no torch
    import torch

log = logging.getLogger(__name__)

COMMANDS_SOCKET = "commands"      # names inside the run directory
REPLIES_SOCKET = "replies"
KV_FILE = "kv"
FAILED_EXIT = 1


# --------------------------------------------------------------------- commands (server -> core)
# call_id: the server's handle for the reply; NO_REPLY asks for none (fire-and-forget).
NO_REPLY = 0


class AddRequest(msgspec.Struct, tag=1, array_like=True):
    call_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str | None
    traffic_class: str | None


class Reserve(msgspec.Struct, tag=2, array_like=True):
    """Decode role: engine.reserve_remote, unless the core reaches it past `deadline_s` (its
    caller has given up by then: nothing is reserved, the reply says `expired`)."""
    call_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str | None
    traffic_class: str | None
    deadline_s: float | None = None   # time.monotonic() (one clock for the whole host); None: none


class StartDecode(msgspec.Struct, tag=3, array_like=True):
    call_id: int
    request_id: str
    first_token: int
    more_first_tokens: list[int] = []   # n > 1: samples 1..n-1's first tokens (they fork here)


class Cancel(msgspec.Struct, tag=4, array_like=True):
    call_id: int
    request_id: str
    sample: int | None = None     # n > 1: end only this sample (its index); None: every sample


class GetStats(msgspec.Struct, tag=5, array_like=True):
    call_id: int


class TakeKVEvents(msgspec.Struct, tag=8, array_like=True):
    """The prefix cache's changes since the last take (or, `snapshot`, all it holds)."""
    call_id: int
    snapshot: bool = False


class Shutdown(msgspec.Struct, tag=7, array_like=True):
    pass


Command = AddRequest | Reserve | StartDecode | Cancel | GetStats | TakeKVEvents | Shutdown


# ---------------------------------------------------------------------- replies (core -> server)
class Ready(msgspec.Struct, tag=20, array_like=True):
    pid: int
    model: str
    block_size: int
    max_model_len: int
    kv_path: str                  # the shared KV file (SharedKV.attach maps it, then unlinks it)
    kv_shape: list[int]           # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
                                  # (TP N: N * num_layers, rank-major; kv_heads a rank's)
    kv_dtype: str                 # torch dtype name without "torch."
    kv_device: str = "cpu"        # where the cache lives: "cpu" (kv_path) or "cuda:N" (kv_handle)
    kv_handle: bytes = b""        # a device cache's CUDA IPC handle (DeviceKV.export)
    warmup: Profile | None = None  # the step times measured before Ready (warm_up); None: none ran


class StepStats(msgspec.Struct, array_like=True):
    """What one engine step that ran the model did (LLMEngine.last_step on the wire). Seconds on
    the core's clock (time.monotonic)."""
    prefill_tokens: int
    decode_tokens: int            # one per decoding sequence
    num_prefill_seqs: int
    num_decode_seqs: int
    duration_s: float
    gap_s: float                  # idle before this step while work waited (0 back to back)
    kv_read_bytes: int            # sum over decode sequences of context x KV bytes per token
    prefix_queries: int           # prompt tokens of the requests admitted this step looked up in
    prefix_hits: int              # the prefix cache / found there
    preemptions: int
    prefill_chunks: list[tuple[str, int]] = []   # (request id, tokens) per prefill chunk
    attention_pairs: int = 0      # (query, key) pairs of the step's prefill chunks and decodes
    prefill_by_class: dict[str, int] = {}      # prefill tokens by their prompts' class
    prompts_by_class: dict[str, float] = {}    # ... and the prompts they were (chunk / prompt)

    @classmethod
    def of(cls, r: StepRecord) -> StepStats:
        return cls(r.prefill_tokens, r.decode_tokens, r.num_prefill_seqs, r.num_decode_seqs,
                   r.duration_s, r.gap_s, r.kv_read_bytes, r.prefix_queries, r.prefix_hits,
                   r.preemptions, r.prefill_chunks, r.attention_pairs, r.prefill_by_class,
                   r.prompts_by_class)


class StepOutputs(msgspec.Struct, tag=21, array_like=True):
    """Everything one step() produced, for every request, in one message. Sent for every step
    that produced outputs or ran the model (a mid-prompt prefill chunk has stats, no outputs).
    The outputs carry token ids and logprobs, no text: see build_engine."""
    outputs: list[TokenOutput]
    sent_at_s: float              # time.monotonic() at send (one clock for the whole host)
    step: StepStats | None = None  # None: the step only flushed outputs (cancelled, rejected)


class Done(msgspec.Struct, tag=22, array_like=True):
    """AddRequest / StartDecode succeeded."""
    call_id: int


class Reserved(msgspec.Struct, tag=23, array_like=True):
    call_id: int
    blocks: list[int] | None      # None: this engine cannot back the reservation, or expired
    expired: bool = False         # refused unrun: the core reached it past its deadline


class Cancelled(msgspec.Struct, tag=24, array_like=True):
    call_id: int
    was_live: bool


class Stats(msgspec.Struct, tag=25, array_like=True):
    call_id: int
    stats: EngineStats


class KVEvents(msgspec.Struct, tag=26, array_like=True):
    """Block hashes stored in / evicted from the prefix cache since the last take. `snapshot`:
    `stored` is everything it holds (asked for, or the change log overflowed)."""
    call_id: int
    stored: list[int]
    evicted: list[int]
    snapshot: bool


class CallFailed(msgspec.Struct, tag=30, array_like=True):
    """The command raised; the core goes on. `kind` names the exception's class (for the engine's
    typed errors, a class of services/engine/errors.py, rebuilt by the client)."""
    call_id: int
    kind: str
    message: str
    param: str | None = None


class Failure(msgspec.Struct, tag=31, array_like=True):
    """The core failed and is exiting: nothing more runs on this engine."""
    kind: str
    message: str
    traceback: str


Reply = (Ready | StepOutputs | Done | Reserved | Cancelled | Stats | KVEvents | CallFailed
         | Failure)

ENCODER = msgspec.msgpack.Encoder()
COMMAND_DECODER = msgspec.msgpack.Decoder(Command)
REPLY_DECODER = msgspec.msgpack.Decoder(Reply)


def ipc_address(run_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(run_dir, name)}"


# ------------------------------------------------------------------------------ shared KV memory
class SharedKV:
    """The KV cache's memory as a file mapped MAP_SHARED by both processes (CPU caches; a CUDA
    cache is DeviceKV's): a torch tensor for the model's cache, a numpy array for the simulated
    core's (which imports no torch)."""

    def __init__(self, path: str) -> None:
        self.path = path                  # tensor-parallel followers map their part of it too
        self.data = None                  # the core's mapping, once allocated

    def alloc(self, shape: tuple[int, ...], dtype):
        """Core side (an LLMEngine kv_alloc): a zeroed tensor over a new shared file."""
        import torch  # noqa: PLC0415 - the model's cache only
        size = math.prod(shape)
        self.data = torch.from_file(self.path, shared=True, size=size, dtype=dtype).view(shape)
        return self.data

    __call__ = alloc

    def alloc_array(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """Core side, the simulated core's kv_alloc: a zeroed numpy array over a new shared file."""
        self.data = np.memmap(self.path, dtype=dtype, mode="w+", shape=tuple(shape))
        return self.data

    @staticmethod
    def attach(ready: Ready):
        """Server side: the core's KV memory as a tensor. The file is unlinked once mapped (the
        mappings keep the memory; nothing is left behind whichever process dies first)."""
        import torch  # noqa: PLC0415
        dtype = getattr(torch, ready.kv_dtype)
        data = torch.from_file(ready.kv_path, shared=True, size=math.prod(ready.kv_shape),
                               dtype=dtype).view(ready.kv_shape)
        os.unlink(ready.kv_path)
        return data

    @staticmethod
    def attach_array(ready: Ready) -> np.ndarray:
        """Server side, a simulated core's: the KV memory as a numpy array (unlinked alike)."""
        data = np.memmap(ready.kv_path, dtype=np.dtype(ready.kv_dtype), mode="r+",
                         shape=tuple(ready.kv_shape))
        os.unlink(ready.kv_path)
        return data


class DeviceKV:
    """A CUDA cache shared with the server by CUDA IPC (torch's reduction of a CUDA tensor: the
    handle of its allocation, its offset, shape and dtype). The core keeps the cache alive as long
    as it runs, so the server's view never outlives it. CUDA only: nothing here runs on a CPU
    build (docs/engine.md, "Device": not yet run on a GPU)."""

    @staticmethod
    def export(data: torch.Tensor) -> bytes:
        """Core side: the handle Ready carries."""
        import torch.multiprocessing  # noqa: F401, PLC0415 - registers the CUDA tensor reductions
        from multiprocessing.reduction import ForkingPickler  # noqa: PLC0415
        return bytes(ForkingPickler.dumps(data))

    @staticmethod
    def attach(ready: Ready) -> torch.Tensor:
        """Server side: the core's device memory as a tensor on the same GPU."""
        import pickle  # noqa: PLC0415
        import torch.multiprocessing  # noqa: F401, PLC0415
        data = pickle.loads(ready.kv_handle)   # our own core's handle, over our own run dir
        if list(data.shape) != list(ready.kv_shape) or str(data.device) != ready.kv_device:
            raise RuntimeError(f"the core's KV handle opened {tuple(data.shape)} on {data.device}, "
                               f"Ready said {ready.kv_shape} on {ready.kv_device}")
        return data


def kv_allocator(config: EngineConfig, shared: SharedKV):
    """The engine's kv_alloc: the shared file for a cache on the CPU (the simulated core's always
    is), None on CUDA (the executor allocates on its device; DeviceKV shares it)."""
    if config.sim is not None:
        return shared.alloc_array
    from services.engine.device import resolve_device  # noqa: PLC0415
    return shared.alloc if resolve_device(config.device).type == "cpu" else None


def ready_message(config: EngineConfig, engine: LLMEngine, shared: SharedKV,
                  warmup: Profile | None = None) -> Ready:
    # the shared file holds every tensor-parallel rank's part (rank 0's cache is its first part)
    data = shared.data if shared.data is not None else engine.kv_cache.data
    device = "cpu" if isinstance(data, np.ndarray) else str(data.device)
    on_device = device != "cpu"
    return Ready(os.getpid(), config.model, engine.pool.block_size, engine.max_model_len,
                 "" if on_device else shared.path, list(data.shape),
                 str(data.dtype).removeprefix("torch."), device,
                 DeviceKV.export(data) if on_device else b"", warmup)


def warm_up(config: EngineConfig, engine: LLMEngine, timeout_s: float) -> Profile | None:
    """The real engine's warm-up profile (services/engine/warmup.py), before Ready: None for a
    simulated core (its prior is its own step timer) or with no time for it (timeout_s <= 0)."""
    if config.sim is not None or timeout_s <= 0:
        return None
    from services.engine import warmup  # noqa: PLC0415
    sched = config.scheduler
    shapes = warmup.default_shapes(sched.token_budget, sched.chunk_size, sched.max_running,
                                   engine.max_model_len)
    result = warmup.profile(engine, shapes, timeout_s)
    log.info("warm-up: %d step shapes measured in %.2f s (%d skipped)%s", len(result.steps),
             result.elapsed_s, result.skipped, f"; stopped: {result.error}" if result.error else "")
    return result


def attach_kv(ready: Ready):
    """Server side: the core's KV memory, wherever it lives (a torch tensor)."""
    return SharedKV.attach(ready) if ready.kv_device == "cpu" else DeviceKV.attach(ready)


def attach_cache(ready: Ready, config: EngineConfig):
    """Server side: the core's KV cache over the same memory, what the transports register: a
    simulated core's ArrayKVCache, else the model's KVCache (every tensor-parallel rank's part,
    with the fp8 scales the core uses: the layout the transports name carries them)."""
    if config.sim is not None:
        return ArrayKVCache.over(SharedKV.attach_array(ready))
    from services.engine.model.kv_cache import KVCache, is_fp8  # noqa: PLC0415 - imports torch
    shared = attach_kv(ready)
    scales = config.kv_cache_scales if is_fp8(shared.dtype) else (1.0, 1.0)
    return KVCache.over(shared, *scales, tensor_parallel_size=config.tensor_parallel_size)


# ------------------------------------------------------------------------------------- the core
class EngineCore:
    """The loop of one engine core process (see the module docstring)."""

    def __init__(self, engine: LLMEngine, commands: zmq.Socket, replies: zmq.Socket,
                 parent_fd: int | None) -> None:
        self.engine = engine
        self.commands = commands
        self.replies = replies
        self.poller = zmq.Poller()
        self.poller.register(commands, zmq.POLLIN)
        self.parent_fd = parent_fd
        self.orphaned = False                    # run() ended because the server is gone
        if parent_fd is not None:                # readable (EOF) once the server process is gone
            self.poller.register(parent_fd, zmq.POLLIN)
        self.ranks: dict[int, object] = {}       # pidfd -> a tensor-parallel follower's Popen
        if engine.tp_leader is not None:         # readable once that rank has exited
            for proc in engine.tp_leader.procs:
                fd = os.pidfd_open(proc.pid)
                self.ranks[fd] = proc
                self.poller.register(fd, zmq.POLLIN)
        self.handlers: dict[type, Callable] = {
            AddRequest: self._add, Reserve: self._reserve, StartDecode: self._start_decode,
            Cancel: self._cancel, GetStats: self._stats, TakeKVEvents: self._kv_events}

    def send(self, reply: Reply) -> None:
        self.replies.send(ENCODER.encode(reply), copy=False)

    def run(self) -> None:
        """Until Shutdown or the server is gone. Exceptions out of step() propagate."""
        while True:
            busy = self.engine.has_unfinished()
            ready = dict(self.poller.poll(0 if busy else None))   # idle: block, no spinning
            if self.parent_fd is not None and self.parent_fd in ready:
                log.warning("the server process is gone; the engine core exits")
                self.orphaned = True
                return
            if any(fd in ready for fd in self.ranks):  # a rank died while idle: fail visibly now
                from services.engine.tp_ranks import TPRankFailed  # noqa: PLC0415 - imports torch
                raise TPRankFailed(self.engine.tp_leader.dead() or "a tensor-parallel rank exited")
            if self.commands in ready and not self._drain():
                return
            if self.engine.has_unfinished():
                started = time.monotonic()
                outputs = self.engine.step()
                record = self.engine.last_step
                self._pace(started)
                if outputs or record is not None:
                    step = StepStats.of(record) if record is not None else None
                    self.send(StepOutputs(outputs, time.monotonic(), step))

    def _pace(self, started: float) -> None:
        """A simulated step ends at its start + its modelled time (wall clock): its outputs are
        sent then. The real engine's steps take what they take (modelled time 0)."""
        left = started + self.engine.last_step_modelled_s - time.monotonic()
        if left > 0:
            time.sleep(left)

    def _drain(self) -> bool:
        """Run every queued command; False on Shutdown."""
        while True:
            try:
                raw = self.commands.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            try:
                cmd = COMMAND_DECODER.decode(raw.buffer)
            except msgspec.DecodeError as e:        # ValidationError included
                self._refuse(raw.buffer, e)
                continue
            if isinstance(cmd, Shutdown):
                return False
            self._handle(cmd)

    def _refuse(self, raw: memoryview, error: msgspec.DecodeError) -> None:
        """A command that does not decode is the server's bug, not the core's: answered with
        CallFailed when its call id can be read, else logged; the core goes on."""
        try:
            fields = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError:
            fields = None
        call_id = fields[1] if isinstance(fields, list) and len(fields) > 1 else None
        if isinstance(call_id, int) and call_id != NO_REPLY:
            self.send(CallFailed(call_id, type(error).__name__, str(error)))
        else:
            log.error("dropped a command that does not decode: %s", error)

    def _handle(self, cmd: Command) -> None:
        try:
            reply = self.handlers[type(cmd)](cmd)
        except Exception as e:  # noqa: BLE001 - the caller's error, not the core's
            if cmd.call_id == NO_REPLY:
                log.warning("%s failed: %s: %s", type(cmd).__name__, type(e).__name__, e)
                return
            reply = CallFailed(cmd.call_id, type(e).__name__, _message(e),
                               getattr(e, "param", None))
        if cmd.call_id != NO_REPLY:
            self.send(reply)

    def _add(self, cmd: AddRequest) -> Done:
        self.engine.add_request(cmd.prompt_token_ids, cmd.params, tenant=cmd.tenant,
                                traffic_class=cmd.traffic_class, request_id=cmd.request_id)
        return Done(cmd.call_id)

    def _reserve(self, cmd: Reserve) -> Reserved:
        if cmd.deadline_s is not None and time.monotonic() > cmd.deadline_s:
            log.warning("%s: Reserve reached the engine %.3f s past its deadline; not reserved",
                        cmd.request_id, time.monotonic() - cmd.deadline_s)
            return Reserved(cmd.call_id, None, expired=True)
        blocks = self.engine.reserve_remote(cmd.prompt_token_ids, cmd.params,
                                            request_id=cmd.request_id, tenant=cmd.tenant,
                                            traffic_class=cmd.traffic_class)
        return Reserved(cmd.call_id, None if blocks is None else list(blocks))

    def _start_decode(self, cmd: StartDecode) -> Done:
        self.engine.start_decode(cmd.request_id, cmd.first_token, cmd.more_first_tokens)
        return Done(cmd.call_id)

    def _cancel(self, cmd: Cancel) -> Cancelled:
        return Cancelled(cmd.call_id, self.engine.cancel(cmd.request_id, cmd.sample))

    def _stats(self, cmd: GetStats) -> Stats:
        return Stats(cmd.call_id, self.engine.stats())

    def _kv_events(self, cmd: TakeKVEvents) -> KVEvents:
        pool = self.engine.pool
        stored, evicted, overflowed = pool.events.take()
        if cmd.snapshot or overflowed:
            return KVEvents(cmd.call_id, pool.cached_hashes(), [], True)
        return KVEvents(cmd.call_id, stored, evicted, False)



def _message(e: BaseException) -> str:
    message = getattr(e, "message", None)
    if isinstance(message, str):
        return message
    if len(e.args) == 1 and isinstance(e.args[0], str):
        return e.args[0]               # KeyError's str() would quote it
    return str(e)


# ----------------------------------------------------------------------------------- entry point
def write_config(stream, config: EngineConfig) -> None:
    """The server's half of the start-up handshake (the core reads it with read_config)."""
    blob = ENCODER.encode(config)
    stream.write(struct.pack("<I", len(blob)) + blob)
    stream.flush()


def read_config(fd: int) -> EngineConfig:
    (size,) = struct.unpack("<I", _read_exactly(fd, 4))
    return msgspec.msgpack.decode(_read_exactly(fd, size), type=EngineConfig)


def _read_exactly(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise EOFError("the server closed the engine core's stdin before sending its config")
        data += chunk
    return data


def build_engine(config: EngineConfig, kv_alloc) -> LLMEngine:
    """The engine this core runs: the model's, or (config.sim set) the simulated core's, which
    loads no weights and whose steps this loop paces to their modelled time. It makes no text
    (EngineConfig.detokenize off): the gateway detokenizes and matches stop strings."""
    return LLMEngine(dataclasses.replace(config, detokenize=False), kv_alloc=kv_alloc)


def main(argv: list[str] | None = None) -> int:
    """The core process. Returns 0 after Shutdown (or the server gone), FAILED_EXIT after a
    Failure (sent to the server first)."""
    p = argparse.ArgumentParser(prog="python -m services.worker.engine_core")
    p.add_argument("run_dir", help="the directory whose sockets the server has bound")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads "
                   "(0: the engine config's torch_threads)")
    p.add_argument("--warmup-timeout", type=float, default=0.0, help="seconds the warm-up "
                   "profile may take before Ready (0: none runs)")
    args = p.parse_args(argv)
    from services.protocol.aio import setup_logging   # noqa: PLC0415
    setup_logging("engine-core")
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C: the server decides and stops us
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(ipc_address(args.run_dir, COMMANDS_SOCKET))
    replies = ctx.socket(zmq.PUSH)
    replies.setsockopt(zmq.SNDHWM, 0)                 # never drop or block on our own output
    replies.connect(ipc_address(args.run_dir, REPLIES_SOCKET))
    status, core, engine = 0, None, None
    try:
        config = read_config(sys.stdin.fileno())
        if args.threads:                      # the worker's --threads; the engine sets them
            config = dataclasses.replace(config, torch_threads=args.threads)
        kv = SharedKV(os.path.join(args.run_dir, KV_FILE))
        engine = build_engine(config, kv_allocator(config, kv))
        faults.install(engine)
        step_trace.install(engine)
        core = EngineCore(engine, commands, replies, sys.stdin.fileno())
        core.send(ready_message(config, engine, kv, warm_up(config, engine, args.warmup_timeout)))
        core.run()
    except BaseException as e:  # noqa: BLE001 - a core failure is reported, never silent
        log.critical("the engine core failed", exc_info=e)
        failure = Failure(type(e).__name__, _message(e), traceback.format_exc())
        replies.send(ENCODER.encode(failure))
        status = FAILED_EXIT
    if engine is not None:
        engine.close()                # tensor-parallel followers (they would also see our exit)
    commands.close(linger=0)
    replies.close(linger=2000)        # let a Failure reach the server before we go
    ctx.term()
    if core is not None and core.orphaned:
        shutil.rmtree(args.run_dir, ignore_errors=True)
    return status


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)                    # no interpreter teardown (torch's can take a while)
