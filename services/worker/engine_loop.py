"""Run an LLMEngine on its own thread and talk to it from asyncio.

Threading contract: only the holder of the engine lock touches the engine: the engine thread
while it iterates or runs commands, or the asyncio thread inside `call()`. asyncio code
  - `await loop.call(fn, *args)`   runs fn(*args) inline when the engine is free (idle and no
                                   command pending), else on the engine thread between iterations;
  - `loop.submit(fn, *args)`       fn(*args) queued for the engine thread, fire-and-forget (safe in
                                   `finally` of a cancelled task);
  - `loop.stream(request_id)`      an OutputStream receiving that request's deltas; open it BEFORE
                                   adding the request so no output can be missed.
The engine thread iterates while the engine has work and sleeps on the command queue otherwise.

GIL hand-off: after posting anything to the asyncio thread (an iteration's tokens, call() results)
the engine thread waits, at most HANDOFF_WAIT_S, for the asyncio thread to run it, so that a first
token is not held behind the next iteration's Python for a switch interval or more, and the
next iteration is not interrupted by the asyncio thread taking the GIL back.

Backpressure: the engine never waits for a client. Deltas queue per stream and a slow consumer
receives them coalesced (tokens, text and logprobs concatenated) the next time it reads.

Failure: an exception out of an iteration (or out of the loop itself) is never silent. The loop
records it (`failure`), logs it with its traceback, and ends its thread; on the asyncio thread
every open stream then raises EngineFailed, every waiting and later `call()` raises it too, and
`on_failure` runs (the worker process marks itself NOT_SERVING, stops heartbeating and exits
non-zero, so `kvfleet up` restarts it). Nothing that waited on the engine hangs.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from services.engine.engine import LLMEngine
from services.engine.outputs import RequestOutput

log = logging.getLogger(__name__)

# After posting to the asyncio thread, the engine thread waits up to this long for it to run what
# was posted (see EngineLoop._hand_off). Bounded, so a busy event loop cannot stall the engine for
# more than this per iteration.
HANDOFF_WAIT_S = 0.002


class EngineFailed(RuntimeError):
    """The engine loop died (see EngineLoop.failure); nothing more runs on this engine."""


class OutputStream:
    """One request's deltas, delivered on the asyncio loop; iteration ends after `finished`."""

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = aio
        self._pending: list[RequestOutput] = []
        self._event = asyncio.Event()
        self._failure: EngineFailed | None = None

    def deliver(self, out: RequestOutput) -> None:       # asyncio thread
        self._pending.append(out)
        self._event.set()

    def fail(self, error: EngineFailed) -> None:         # asyncio thread
        self._failure = error
        self._event.set()

    async def next(self) -> RequestOutput:
        """The deltas that arrived since the last read, merged into one. Raises EngineFailed once
        the engine died (deltas that arrived before are still read first)."""
        while not self._pending:
            if self._failure is not None:
                raise self._failure
            self._event.clear()
            await self._event.wait()
        outs, self._pending = self._pending, []
        return merge(outs)

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        while True:
            out = await self.next()
            yield out
            if out.finished:
                return


def merge(outs: list[RequestOutput]) -> RequestOutput:
    first = outs[0]
    if len(outs) == 1:
        return first
    last = outs[-1]
    return RequestOutput(
        request_id=first.request_id,
        new_token_ids=[t for o in outs for t in o.new_token_ids],
        new_text="".join(o.new_text for o in outs),
        new_logprobs=[lp for o in outs for lp in o.new_logprobs],
        finished=last.finished, finish_reason=last.finish_reason, stop_reason=last.stop_reason,
        error=last.error, retry_after_s=last.retry_after_s,
        prompt_logprobs=next((o.prompt_logprobs for o in outs if o.prompt_logprobs), None),
        num_prompt_tokens=last.num_prompt_tokens, num_output_tokens=last.num_output_tokens)


class EngineLoop:
    def __init__(self, engine: LLMEngine, aio: asyncio.AbstractEventLoop,
                 idle_wait_s: float = 0.05, handoff_wait_s: float = HANDOFF_WAIT_S,
                 on_failure: Callable[[EngineFailed], None] | None = None) -> None:
        self.engine = engine
        self.failure: EngineFailed | None = None   # set once, by the engine thread, on failure
        self._on_failure = on_failure
        self._waiting: set[asyncio.Future] = set()   # call() results not yet settled
        self._aio = aio
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, OutputStream] = {}
        self._lock = threading.Lock()            # guards _streams
        self._engine_lock = threading.Lock()     # held by whichever thread is in the engine
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._handoff_wait_s = handoff_wait_s
        self._handed_off = threading.Event()
        self._answered = False       # a call() result was posted since the last hand-off
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=10)

    async def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """fn(*args, **kwargs) on the engine. Inline, on this thread, when the engine is free (no
        iteration running, no command queued or running: so commands still run in the order they
        were issued); otherwise on the engine thread between iterations."""
        if self.failure is not None:
            raise self.failure
        # Only this (the asyncio) thread queues commands, so none can appear between the check
        # and the call: `unfinished_tasks` only falls meanwhile.
        if self._commands.unfinished_tasks == 0 and self._engine_lock.acquire(blocking=False):
            try:
                return fn(*args, **kwargs)
            finally:
                if self.engine.has_unfinished():
                    self._commands.put(_wake)    # fn gave the idle engine thread something to do
                self._engine_lock.release()
        fut: asyncio.Future = self._aio.create_future()

        def run() -> None:
            self._answered = True
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._aio.call_soon_threadsafe(_settle, fut, None, e)
            else:
                self._aio.call_soon_threadsafe(_settle, fut, result, None)

        self._commands.put(run)
        self._waiting.add(fut)
        try:
            return await fut
        finally:
            self._waiting.discard(fut)

    def submit(self, fn: Callable[..., Any], *args, **kwargs) -> None:
        self._commands.put(lambda: fn(*args, **kwargs))

    def stream(self, request_id: str) -> OutputStream:
        stream = OutputStream(self._aio)
        if self.failure is not None:
            stream.fail(self.failure)
            return stream
        with self._lock:
            self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._iterate()
        except BaseException as e:  # noqa: BLE001 - an engine failure must never be silent
            self._fail(e)

    def _fail(self, cause: BaseException) -> None:
        log.critical("engine loop failed; failing every request it holds", exc_info=cause)
        failure = EngineFailed(f"the engine failed: {type(cause).__name__}: {cause}")
        failure.__cause__ = cause
        self.failure = failure          # from here call() and stream() fail at once
        try:
            self._aio.call_soon_threadsafe(self._fail_waiters, failure)
        except RuntimeError:
            pass                        # the event loop is closed: the process is ending anyway

    def _fail_waiters(self, failure: EngineFailed) -> None:
        """Asyncio thread: every open stream and every waiting call() raises `failure`."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.fail(failure)
        for fut in list(self._waiting):
            _settle(fut, None, failure)
        if self._on_failure is not None:
            self._on_failure(failure)

    def _iterate(self) -> None:
        while not self._stop.is_set():
            with self._engine_lock:
                idle = not self.engine.has_unfinished()
            self._drain_commands(block=idle)
            if self._answered:
                self._answered = False
                self._hand_off()
            with self._engine_lock:
                outputs = self.engine.step() if self.engine.has_unfinished() else []
            if outputs:
                self._route(outputs)

    def _drain_commands(self, block: bool) -> None:
        """Run every queued command, under the engine lock; each is marked done (task_done) only
        after it ran, so call() never runs inline ahead of a command issued before it."""
        try:
            cmd = self._commands.get(timeout=self._idle_wait_s) if block else \
                self._commands.get_nowait()
        except queue.Empty:
            return
        with self._engine_lock:
            while True:
                try:
                    cmd()
                finally:
                    self._commands.task_done()
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    return

    def _route(self, outputs: list[RequestOutput]) -> None:
        """One wake-up of the asyncio loop per iteration, however many streams got output."""
        routed = []
        with self._lock:
            for out in outputs:
                stream = (self._streams.pop(out.request_id, None) if out.finished
                          else self._streams.get(out.request_id))
                if stream is not None:
                    routed.append((stream, out))
        if routed:
            self._aio.call_soon_threadsafe(_deliver_all, routed)
            self._hand_off()

    def _hand_off(self) -> None:
        """Wait (at most handoff_wait_s) until the asyncio thread has run what this thread just
        posted to it, and the handlers that woke up, as far as their next await (a send).
        Holding the GIL through the next iteration instead would keep a finished token (or a
        request's acceptance) waiting for a switch interval or more."""
        self._handed_off.clear()
        self._aio.call_soon_threadsafe(self._aio.call_soon, self._handed_off.set)
        self._handed_off.wait(self._handoff_wait_s)


def _wake() -> None:
    """A no-op command: wakes the engine thread when it idles on the command queue."""


def _deliver_all(routed: list[tuple[OutputStream, RequestOutput]]) -> None:
    for stream, out in routed:
        stream.deliver(out)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
