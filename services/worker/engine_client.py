"""The server process's handle on its engine core (services/worker/engine_core.py).

    client = EngineClient(config, on_failure=..., on_step=...)
    await client.start()                  spawn the core, wait for Ready, map its KV memory
    stream = client.stream(rid)           open BEFORE adding, so no output can be missed
    await client.add_request(rid, ...)    typed commands; each await resolves with the core's reply
    async for out in stream: ...          that request's deltas; ends after `finished`
    client.cancel_soon(rid)               fire-and-forget (safe in `finally` of a cancelled task)
    await client.close()                  Shutdown, then SIGTERM, then SIGKILL; idempotent

Everything runs on the asyncio loop: one reader task decodes the core's messages (replies resolve
the futures of pending calls; each step's outputs are routed to the open streams) and the core
process is watched with loop.add_reader on its pidfd. No threads, no GIL choreography.
`on_step(StepStats)` runs on the loop for every step that ran the model, before that step's
outputs are routed (telemetry: batch composition, gaps, KV read volume, prefix-cache lookups).

The core is `python -m services.worker.engine_core RUN_DIR` (a fresh interpreter: nothing of the
server's main module is re-imported, as multiprocessing's spawn would). Its stdin carries the
EngineConfig, then stays open: the core exits when it reaches EOF, i.e. when this process is gone.

Backpressure: the core never waits for a client. Deltas queue per stream; a reader that keeps up
gets them one by one (one token per decode step), and a reader more than MERGE_BACKLOG behind gets
them coalesced (tokens and logprobs concatenated) the next time it reads.

Failure: when the core sends a Failure, or exits without one (killed, crashed), every open
stream and every pending and later call raises EngineFailed, `failure` is set, and `on_failure`
runs once (the worker marks itself NOT_SERVING and exits ENGINE_FAILED_EXIT). Nothing that waited
on the engine hangs.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable

import zmq
import zmq.asyncio

from services.engine import errors
from services.engine.config import EngineConfig
from services.engine.engine import EngineStats
from services.engine.outputs import TokenOutput
from services.engine.sampling_params import SamplingParams
from services.protocol import env
from services.worker import engine_core as core
from services.worker.engine_core import (ENCODER, REPLY_DECODER, CallFailed, Cancelled,
                                         Done, Failure, Ready, Reserved, Stats, StepOutputs,
                                         StepStats)

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0    # loading a large model's weights takes a while
EXIT_GRACE_S = 0.5         # close(): after Shutdown, then again after SIGTERM, before SIGKILL
KILLED_EXIT_S = 10.0       # close(): after SIGKILL, for the news of the exit
FAILURE_GRACE_S = 1.0      # the core exited: how long its Failure message may still be in flight


class EngineFailed(RuntimeError):
    """The engine core died (see EngineClient.failure); nothing more runs on this engine."""

    core_traceback: str | None = None     # the core's own traceback, when it sent a Failure


class EngineCallError(RuntimeError):
    """A command raised in the core something other than the engine's typed errors."""


# Deltas a reader may fall behind and still get one message per delta: a few steps' worth, as
# when the event loop was busy for a moment. Further behind, the reader gets them merged.
MERGE_BACKLOG = 4


class OutputStream:
    """One request's deltas, delivered on the asyncio loop; iteration ends after `finished`."""

    def __init__(self) -> None:
        self._pending: list[TokenOutput] = []
        self._event = asyncio.Event()
        self._failure: EngineFailed | None = None

    def deliver(self, out: TokenOutput) -> None:
        self._pending.append(out)
        self._event.set()

    def fail(self, error: EngineFailed) -> None:
        self._failure = error
        self._event.set()

    async def next(self) -> TokenOutput:
        """The oldest delta, as the engine sent it (one token per decode step), while the reader
        keeps up. A reader more than MERGE_BACKLOG deltas behind (a slow client) gets them all
        merged into one (n > 1: the leading run of one sample's deltas; the others stay for the
        next read), so it catches up in one message. Raises EngineFailed once the engine died
        (deltas that arrived before are still read first)."""
        while not self._pending:
            if self._failure is not None:
                raise self._failure
            self._event.clear()
            await self._event.wait()
        if len(self._pending) <= MERGE_BACKLOG:
            return self._pending.pop(0)
        index = self._pending[0].index
        run = next((i for i, o in enumerate(self._pending) if o.index != index),
                   len(self._pending))
        outs, self._pending = self._pending[:run], self._pending[run:]
        return merge(outs)

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            out = await self.next()
            yield out
            if out.finished:
                return


def merge(outs: list[TokenOutput]) -> TokenOutput:
    first = outs[0]
    if len(outs) == 1:
        return first
    last = outs[-1]
    return TokenOutput(
        request_id=first.request_id,
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        new_logprobs=[lp for o in outs for lp in o.new_logprobs],
        finished=last.finished, finish_reason=last.finish_reason, stop_reason=last.stop_reason,
        error=last.error, retry_after_s=last.retry_after_s,
        prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs), None),
        num_prompt_tokens=last.num_prompt_tokens, num_output_tokens=last.num_output_tokens,
        block_ids=last.block_ids,
        queue_s=next((o.queue_s for o in outs if o.queue_s is not None), None),
        prefill_s=next((o.prefill_s for o in outs if o.prefill_s is not None), None),
        index=first.index, num_cached_tokens=max(o.num_cached_tokens for o in outs),
        prefilled=last.prefilled)


class EngineClient:
    def __init__(self, config: EngineConfig, *,
                 on_failure: Callable[[EngineFailed], None] | None = None,
                 on_step: Callable[[StepStats], None] | None = None,
                 torch_threads: int = 0, start_timeout_s: float = START_TIMEOUT_S,
                 warmup_timeout_s: float = 0.0) -> None:
        """warmup_timeout_s: how long the core's warm-up profile may take before Ready
        (engine_core.warm_up; 0: none runs, `warmup` is None)."""
        self.config = config
        self._warmup_timeout_s = warmup_timeout_s
        self.failure: EngineFailed | None = None
        self._on_failure = on_failure
        self._on_step = on_step
        self._torch_threads = torch_threads
        self._start_timeout_s = start_timeout_s
        self._ids = itertools.count(core.NO_REPLY + 1)
        self._calls: dict[int, asyncio.Future] = {}
        self._streams: dict[str, OutputStream] = {}
        self._ready: Ready | None = None
        self._kv_cache = None     # a KVCache, or a simulated core's ArrayKVCache
        self._run_dir: str | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._commands: zmq.asyncio.Socket | None = None
        self._replies: zmq.asyncio.Socket | None = None
        self._proc: subprocess.Popen | None = None
        self._pidfd: int | None = None
        self._reader: asyncio.Task | None = None
        self._ready_fut: asyncio.Future | None = None
        self._exited: asyncio.Event | None = None     # the core process ended
        self._failed: asyncio.Event | None = None     # `failure` is set
        self._watch: asyncio.Task | None = None       # _exited_without_failure, once the core ended
        self._closing = False

    # ------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Spawn the core and wait for Ready. Raises EngineFailed if it fails or dies first, or
        does not answer within start_timeout_s (the core is then stopped)."""
        loop = asyncio.get_running_loop()
        self._run_dir = tempfile.mkdtemp(prefix="kvfleet-core-", dir=_shm_dir())
        self._zmq = zmq.asyncio.Context()
        self._commands = self._zmq.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.bind(core.ipc_address(self._run_dir, core.COMMANDS_SOCKET))
        self._replies = self._zmq.socket(zmq.PULL)
        self._replies.setsockopt(zmq.RCVHWM, 0)
        self._replies.bind(core.ipc_address(self._run_dir, core.REPLIES_SOCKET))
        self._ready_fut = loop.create_future()
        self._exited, self._failed = asyncio.Event(), asyncio.Event()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "services.worker.engine_core", self._run_dir,
             "--threads", str(self._torch_threads),
             "--warmup-timeout", str(self._warmup_timeout_s)],
            stdin=subprocess.PIPE, stdout=2, env=_core_env())   # stdout: the server's READY line
        core.write_config(self._proc.stdin, self.config)   # stdin stays open (see above)
        self._pidfd = os.pidfd_open(self._proc.pid)
        loop.add_reader(self._pidfd, self._core_exited)
        self._reader = asyncio.create_task(self._read(), name="engine-client-reader")
        try:
            self._ready = await asyncio.wait_for(asyncio.shield(self._ready_fut),
                                                 self._start_timeout_s)
            self._kv_cache = core.attach_cache(self._ready, self.config)
        except BaseException as e:
            await self.close()
            if isinstance(e, asyncio.TimeoutError):
                raise EngineFailed(f"the engine core did not start within "
                                   f"{self._start_timeout_s:.0f} s") from None
            raise

    async def close(self) -> None:
        """Stop the core (Shutdown; SIGTERM and SIGKILL if it lingers) and release everything.
        Idempotent. Pending calls and open streams raise EngineFailed; on_failure does not run."""
        if self._closing:
            return
        self._closing = True
        if self._proc is not None:
            await self._stop_core()
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._proc.stdin.close()
        for task in (self._reader, self._watch):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for sock in (self._commands, self._replies):
            if sock is not None:
                sock.close(linger=0)
        if self._zmq is not None:
            self._zmq.term()
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
        self._fail_waiters(self.failure or EngineFailed("the engine client is closed"))

    async def _stop_core(self) -> None:
        proc = self._proc
        if proc.poll() is None:
            self._commands.send(ENCODER.encode(core.Shutdown()))
        # After SIGKILL the exit is certain, but on a loaded host its news (the pidfd reader on
        # this loop) can take longer than the grace: wait for it longer rather than fail the stop.
        for signal_next, grace in ((proc.terminate, EXIT_GRACE_S), (proc.kill, EXIT_GRACE_S),
                                   (None, KILLED_EXIT_S)):
            try:
                await asyncio.wait_for(self._exited.wait(), grace)
                break
            except asyncio.TimeoutError:
                if signal_next is None:
                    break
                log.warning("the engine core (pid %s) did not exit; %s", proc.pid,
                            signal_next.__name__)
                signal_next()
        try:
            proc.wait(EXIT_GRACE_S)    # it has exited: reaping takes no time
        except subprocess.TimeoutExpired:
            log.error("the engine core (pid %s) is still running %.0f s after SIGKILL", proc.pid,
                      KILLED_EXIT_S)

    # ----------------------------------------------------------------------- properties
    @property
    def kv_cache(self):
        """The core's KV cache, over the same (shared) memory: for transport.register."""
        return self._started(self._kv_cache)

    @property
    def block_size(self) -> int:
        return self._started(self._ready).block_size

    @property
    def model(self) -> str:
        return self._started(self._ready).model

    @property
    def max_model_len(self) -> int:
        return self._started(self._ready).max_model_len

    @property
    def warmup(self):
        """What the core's warm-up measured before Ready (services/engine/warmup.py, Profile),
        or None (a simulated core, or none asked for)."""
        return self._started(self._ready).warmup

    @property
    def kv_device(self) -> str:
        """Where the core's model and KV cache live: "cpu", or a CUDA device ("cuda:0")."""
        return self._started(self._ready).kv_device

    @property
    def pid(self) -> int | None:
        """The core process's pid (None before start)."""
        return self._proc.pid if self._proc is not None else None

    @staticmethod
    def _started(value):
        if value is None:
            raise RuntimeError("EngineClient.start() has not completed")
        return value

    # ------------------------------------------------------------------------- commands
    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, tenant: str | None,
                          traffic_class: str | None) -> None:
        """Raises the engine's InvalidRequestError subclass for a bad request."""
        await self._call(lambda cid: core.AddRequest(cid, request_id, list(prompt_token_ids),
                                                     params, tenant, traffic_class), Done)

    async def reserve(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, tenant: str | None, traffic_class: str | None,
                      deadline_s: float | None = None,
                      abandoned: Callable[[str, str], None] | None = None) -> list[int] | None:
        """Decode role: the blocks the prompt's KV must be written into, or None if refused.

        No reservation outlives a caller that gave up: the core refuses the Reserve unrun past
        `deadline_s` (time.monotonic()), and a reservation whose reply comes after the caller
        was cancelled is cancelled in the core at once. Each time, `abandoned(request_id, how)`
        is told: "expired" (refused past its deadline) or "late" (made for no one, undone)."""
        call_id, fut = self._send(lambda cid: core.Reserve(
            cid, request_id, list(prompt_token_ids), params, tenant, traffic_class, deadline_s))
        try:
            reply = await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: self._reserve_gone(request_id, f, abandoned))
            raise
        reply = _answer(reply, Reserved)
        if reply.expired and abandoned is not None:
            abandoned(request_id, "expired")
        return reply.blocks

    def _reserve_gone(self, request_id: str, fut: asyncio.Future,
                      abandoned: Callable[[str, str], None] | None) -> None:
        """The reply to a Reserve whose caller had gone: undo what it reserved."""
        if fut.cancelled() or fut.exception() is not None:
            return                       # the engine failed: it holds nothing any more
        reply = fut.result()
        if not isinstance(reply, Reserved) or not (reply.blocks is not None or reply.expired):
            return
        how = "expired" if reply.expired else "late"
        if reply.blocks is not None:
            self.cancel_soon(request_id)
            log.warning("%s: the engine reserved %d blocks after the Reserve's caller had gone; "
                        "cancelled", request_id, len(reply.blocks))
        if abandoned is not None:
            abandoned(request_id, how)

    async def start_decode(self, request_id: str, first_token: int,
                           more_first_tokens: list[int] | None = None) -> None:
        """n > 1: `more_first_tokens` are samples 1..n-1's (the engine forks them)."""
        await self._call(lambda cid: core.StartDecode(cid, request_id, first_token,
                                                      list(more_first_tokens or ())), Done)

    async def cancel(self, request_id: str, sample: int | None = None) -> bool:
        """Frees every page the request holds (`sample` set: only that sample of its n, the
        others go on); True if it was live."""
        reply = await self._call(lambda cid: core.Cancel(cid, request_id, sample), Cancelled)
        return reply.was_live

    def cancel_soon(self, request_id: str) -> None:
        """Cancel without waiting for the answer (synchronous; a no-op once the core is gone)."""
        if self.failure is None and not self._closing and self._commands is not None:
            self._commands.send(ENCODER.encode(core.Cancel(core.NO_REPLY, request_id)))

    async def stats(self) -> EngineStats:
        return (await self._call(core.GetStats, Stats)).stats

    async def kv_events(self, snapshot: bool = False) -> core.KVEvents:
        """The prefix cache's changes since the last call (services/worker/kv_events.py)."""
        return await self._call(lambda call_id: core.TakeKVEvents(call_id, snapshot), core.KVEvents)

    def stream(self, request_id: str) -> OutputStream:
        stream = OutputStream()
        if self.failure is not None:
            stream.fail(self.failure)
        else:
            self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def _call(self, make: Callable[[int], core.Command], expect: type):
        call_id, fut = self._send(make)
        try:
            reply = await fut
        finally:
            self._calls.pop(call_id, None)
        return _answer(reply, expect)

    def _send(self, make: Callable[[int], core.Command]) -> tuple[int, asyncio.Future]:
        """Send a command; its reply resolves the future (and unregisters it)."""
        if self.failure is not None:
            raise self.failure
        if self._closing or self._commands is None:
            raise EngineFailed("the engine client is not running")
        call_id = next(self._ids)
        fut = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            self._commands.send(ENCODER.encode(make(call_id)))
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        return call_id, fut

    # ---------------------------------------------------------------- the core's messages
    async def _read(self) -> None:
        try:
            while True:
                raw = await self._replies.recv(copy=False)
                self._dispatch(REPLY_DECODER.decode(raw.buffer))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken reader must fail the waiters, not hang them
            log.exception("engine client: reading the core's messages failed")
            self._fail(EngineFailed(f"reading the engine core's messages failed: {e!r}"))

    def _dispatch(self, msg: core.Reply) -> None:
        if isinstance(msg, StepOutputs):
            if msg.step is not None and self._on_step is not None:
                self._step_observed(msg.step)
            self._route(msg.outputs)
        elif isinstance(msg, Failure):
            self._core_failed(msg)
        elif isinstance(msg, Ready):
            if not self._ready_fut.done():
                self._ready_fut.set_result(msg)
        else:                          # a call's reply
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _step_observed(self, step: StepStats) -> None:
        """Telemetry never breaks serving: a failing on_step is logged, the outputs still go."""
        try:
            self._on_step(step)
        except Exception:  # noqa: BLE001
            log.exception("engine client: on_step failed")

    def _route(self, outputs: list[TokenOutput]) -> None:
        for out in outputs:
            stream = (self._streams.pop(out.request_id, None) if out.finished
                      else self._streams.get(out.request_id))
            if stream is not None:
                stream.deliver(out)

    def _core_failed(self, msg: Failure) -> None:
        log.critical("the engine core failed:\n%s", msg.traceback)
        failure = EngineFailed(f"the engine core failed: {msg.kind}: {msg.message}")
        failure.core_traceback = msg.traceback
        self._fail(failure)

    def _core_exited(self) -> None:
        """The core process ended (its pidfd is readable)."""
        asyncio.get_running_loop().remove_reader(self._pidfd)
        self._exited.set()
        if not self._closing and self.failure is None:
            self._watch = asyncio.create_task(self._exited_without_failure())

    async def _exited_without_failure(self) -> None:
        """A Failure the core sent just before exiting may still be in flight: give it a moment,
        then fail with the exit status."""
        try:
            await asyncio.wait_for(self._failed.wait(), FAILURE_GRACE_S)
        except asyncio.TimeoutError:
            pass
        code = self._proc.wait(FAILURE_GRACE_S)    # it has exited: reaping takes no time
        if self.failure is None and not self._closing:
            self._fail(EngineFailed(f"the engine core exited unexpectedly ({_describe_exit(code)})"))

    def _fail(self, failure: EngineFailed) -> None:
        if self.failure is not None:
            return
        self.failure = failure
        self._failed.set()
        self._fail_waiters(failure)
        started = self._kv_cache is not None     # a core that fails to start: start() raises
        if self._on_failure is not None and started and not self._closing:
            self._on_failure(failure)

    def _fail_waiters(self, failure: EngineFailed) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.fail(failure)
        for fut in list(self._calls.values()):
            if not fut.done():
                fut.set_exception(failure)
        if self._ready_fut is not None and not self._ready_fut.done():
            self._ready_fut.set_exception(failure)
            self._ready_fut.exception()   # retrieved: no "never retrieved" warning


def _answer(reply, expect: type):
    """A call's reply, or the error it carries raised."""
    if isinstance(reply, CallFailed):
        raise _rebuild(reply)
    assert isinstance(reply, expect), f"{type(reply).__name__} answered a {expect.__name__}"
    return reply


def _rebuild(reply: CallFailed) -> Exception:
    """The engine's typed error as raised in the core (same class, code and message)."""
    cls = getattr(errors, reply.kind, None)
    if isinstance(cls, type) and issubclass(cls, (errors.InvalidRequestError,
                                                  errors.UnknownRequestError)):
        error = cls(reply.message)
        if reply.param is not None:
            error.param = reply.param
        return error
    return EngineCallError(f"{reply.kind}: {reply.message}")


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "status unknown"
    return f"killed by signal {-code}" if code < 0 else f"status {code}"


def _core_env() -> dict[str, str]:
    """This environment (fault injection included), with this checkout importable."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = env.PYTHONPATH.get()
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _shm_dir() -> str | None:
    """/dev/shm where there is one (the KV file is memory, not disk); else the temp dir."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
