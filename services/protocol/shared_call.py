"""Many requests over one long-lived call between two processes (a shared call), each by its id.

A unary call costs a new HTTP/2 stream, the fleet token's interceptors and the call objects on
both sides: 1.5-2 ms between two processes of this host after a few idle milliseconds. A message
on a call that is already open costs a fraction of that. So the gateway keeps one AdmitStream per
router and one PrefillStream per prefill worker, the router one ReserveStream per decode worker
(and the gateway one DecodeStream per decode or mixed worker: services/worker/token_stream.py),
and each request is one ask on it, answered once (Admit, Reserve) or by a stream of notes
(Prefill: accepted, replies, end or failure). What a call of its own would carry travels in the
ask (`pb.CallTerms`): its deadline and its trace context. The fleet token is checked once, when the shared call opens.

Server side, `answer_asks`: each ask runs the service's own handler in a task of its own with a
`StreamedContext` (the slice of grpc's ServicerContext the handlers use: its deadline, its
metadata, `abort` raising status.CallFailed, `send_initial_metadata` as an `accepted` note, done
callbacks and `cancelled()`; a streaming handler's replies go out through `send`); the task is
cancelled at the ask's deadline, on its `cancel`, or when the shared call ends, just as grpc
cancels a handler whose call ended, so every handler keeps its cleanup.

Client side, `SharedCall`: `ask` sends one request and waits for its answer within the request's
deadline (`stream`: a StreamedRequest, read as a streamed call is); a deadline passed or a
caller cancelled sends `cancel`, so the server undoes what it did. An answer that comes for a
request its caller gave up (the cancel crossed it on the way, or came after the answer was
delivered but before the caller took it) is the caller's `orphaned(answer)` to undo: the server
had finished, so its cancel undoes nothing there. The call breaking (the peer died) fails every
request waiting on it UNAVAILABLE, with the bare code a dead peer's unary call would raise (`untyped_code`), so callers fail over the same
way; the next ask opens a new call, unless it comes within a short backoff after the last break
(doubling while new calls break before any answer): then it fails UNAVAILABLE at once, so a
gateway asks its next router without waiting. The channel's own reconnect backoff governs the
connection.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc

from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb

log = logging.getLogger(__name__)

Ask = TypeVar("Ask")
Answer = TypeVar("Answer")


def terms(timeout_s: float | None, metadata: tuple[tuple[str, str], ...] | None) -> pb.CallTerms:
    """The call terms of one request: its timeout and its trace context (`metadata`: what
    tracing.outgoing() makes, the W3C keys)."""
    return pb.CallTerms(timeout_s=timeout_s or 0.0, trace=dict(metadata or ()))


class StreamedContext:
    """One request on a shared call, as its handler sees a call's context."""

    def __init__(self, call_terms: pb.CallTerms, send: Callable[[Any], None] | None = None,
                 on_headers: Callable[[], None] | None = None) -> None:
        self.send = send                  # a streaming handler's answers go out through it
        self._on_headers = on_headers
        self._deadline = (time.monotonic() + call_terms.timeout_s
                          if call_terms.timeout_s > 0 else None)
        self._metadata = tuple(call_terms.trace.items())
        self._failure: pb.CallStatus | None = None
        self._callbacks: list[Callable[[StreamedContext], None]] = []
        self._cancelled = False
        self._done = False

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def set_trailing_metadata(self, metadata) -> None:
        for key, value in metadata:
            if key == status.STATUS_KEY:
                self._failure = pb.CallStatus.FromString(value)

    async def abort(self, code: grpc.StatusCode, details: str = ""):
        """End the request with the CallStatus status.abort set (raised as status.CallFailed)."""
        raise status.CallFailed(self._failure or status.failed(pb.REASON_UNSPECIFIED, details))

    async def send_initial_metadata(self, metadata) -> None:
        """The headers' news (the request was taken) as an answer of its own, where the call's
        shape has one; otherwise the answer itself says it."""
        if self._on_headers is not None:
            self._on_headers()
            self._on_headers = None

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, callback: Callable[[StreamedContext], None]) -> None:
        self._callbacks.append(callback)

    def end(self, cancelled: bool) -> None:
        self._done, self._cancelled = True, cancelled
        for callback in self._callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - one callback's bug must not stop the others
                log.exception("a done callback of a streamed request failed")


@dataclass(frozen=True)
class AskShape(Generic[Ask, Answer]):
    """How one shared call's messages look: an ask's id, terms and cancel flag; an answer."""
    request_id: Callable[[Ask], str]
    call_terms: Callable[[Ask], pb.CallTerms]
    is_cancel: Callable[[Ask], bool]
    answered: Callable[[str, Any], Answer]               # (request id, the handler's reply)
    failed: Callable[[str, pb.CallStatus], Answer]       # (request id, why)
    accepted: Callable[[str], Answer] | None = None      # the handler sent its headers


def deadline_passed(request_id: str) -> pb.CallStatus:
    return status.failed(pb.UNAVAILABLE, f"{request_id}: its deadline passed on the shared call")


async def answer_asks(asks: AsyncIterator, handle: Callable[[Any, StreamedContext], Awaitable],
                      shape: AskShape, late_cancel: Callable[[str], Any] | None = None
                      ) -> AsyncIterator:
    """Serve one shared call: each ask runs `handle(ask, context)` in a task of its own, and its
    answer (or failure) is sent as soon as it is ready. A `cancel` for a request no longer
    running calls `late_cancel(request_id)` (undo what its answer gave). The call ending cancels
    every request still running on it."""
    answers: asyncio.Queue = asyncio.Queue()
    running: dict[str, asyncio.Task] = {}
    loop = asyncio.get_running_loop()

    async def one(rid: str, ask, context: StreamedContext) -> None:
        cancelled = True
        try:
            async with asyncio.timeout(context.time_remaining()):    # no task of its own
                reply = await handle(ask, context)
            cancelled = False
            answers.put_nowait(shape.answered(rid, reply))
        except status.CallFailed as e:
            cancelled = False
            answers.put_nowait(shape.failed(rid, e.status))
        except asyncio.TimeoutError:
            answers.put_nowait(shape.failed(rid, deadline_passed(rid)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a handler's bug fails its request, not the call
            log.exception("%s: the handler failed", rid)
            cancelled = False
            answers.put_nowait(shape.failed(rid, status.failed(pb.REASON_UNSPECIFIED, repr(e))))
        finally:
            if running.get(rid) is asyncio.current_task():
                del running[rid]
            context.end(cancelled)

    async def read() -> None:
        async for ask in asks:
            rid = shape.request_id(ask)
            if shape.is_cancel(ask):
                task = running.pop(rid, None)
                if task is not None:
                    task.cancel()
                elif late_cancel is not None:
                    late_cancel(rid)
            elif rid in running:
                answers.put_nowait(shape.failed(rid, status.failed(
                    pb.INVALID_REQUEST, f"request id {rid!r} is already asked on this call")))
            else:
                running[rid] = loop.create_task(one(rid, ask, StreamedContext(
                    shape.call_terms(ask), answers.put_nowait, _headers(shape, rid, answers))))
        answers.put_nowait(None)            # the caller half-closed: answer what runs, then end

    reader = loop.create_task(read())
    closing = False
    try:
        while True:
            answer = await answers.get()
            if answer is None:
                closing = True
            else:
                yield answer
            if closing and not running and answers.empty():
                return
    finally:
        reader.cancel()
        for task in list(running.values()):
            task.cancel()


def _headers(shape: AskShape, rid: str, answers: asyncio.Queue) -> Callable[[], None] | None:
    if shape.accepted is None:
        return None
    return lambda: answers.put_nowait(shape.accepted(rid))


BACKOFF_S = (0.05, 1.0)        # after a break: the first wait before a new call, and the most
# How long an ask given up still waits for an answer that crossed its cancel: a peer that had
# answered before the cancel came sends nothing more, and one that had not sends nothing at all,
# so this bounds only what is remembered (a loaded peer may take seconds to read the cancel).
ORPHAN_WAIT_S = 60.0


class SharedCall(Generic[Ask, Answer]):
    """The client half: one long-lived call to one peer, opened on first use and again after it
    broke. `open_call(requests)` starts the call (a TypedStub method). A request waits for one
    answer (`ask`) or reads a stream of them (`stream`)."""

    def __init__(self, open_call: Callable[[AsyncIterator], Any], address: str,
                 answer_id: Callable[[Answer], str], cancel_of: Callable[[str], Ask],
                 orphaned: Callable[[Answer], None] | None = None) -> None:
        self.address = address
        self._open_call = open_call
        self._answer_id = answer_id
        self._cancel_of = cancel_of
        self._orphaned = orphaned          # an `ask`'s answer that came after its caller went
        # asks given up whose answer may still come -> until when one is awaited (time.monotonic)
        self._given_up: dict[str, float] = {}
        self._call = None
        self._out: asyncio.Queue | None = None
        self._waiting: dict[str, _Unary | StreamedRequest] = {}
        self._reader: asyncio.Task | None = None
        self._backoff_s = 0.0
        self._broke_at = float("-inf")
        self.opened = 0               # calls opened (tests read it)

    @property
    def broken(self) -> bool:
        return self._call is None

    async def ask(self, request_id: str, ask: Ask, timeout_s: float | None) -> Answer:
        """The answer to `ask`, within `timeout_s`. Raises status.CallFailed with the bare code a
        unary call would (DEADLINE_EXCEEDED, UNAVAILABLE) when no answer comes."""
        unary = self._send(request_id, ask, _Unary())
        try:
            async with asyncio.timeout(timeout_s):
                return await unary.future
        except asyncio.TimeoutError:
            self._give_up(request_id, unary)
            raise no_answer(request_id, self.address, timeout_s) from None
        except asyncio.CancelledError:
            self._give_up(request_id, unary)
            raise
        finally:
            if self._waiting.get(request_id) is unary:
                del self._waiting[request_id]

    def _give_up(self, request_id: str, unary: _Unary) -> None:
        """The caller went: the peer is told (a late cancel, where it answered already: a
        ReserveStream undoes its answer then). With an `orphaned` hook, an answer already
        delivered (the caller was cancelled before it woke) is orphaned now instead, and one
        that crosses the cancel on the way is orphaned when it comes (`_read`)."""
        answer = unary.answer()
        if answer is not None and self._orphaned is not None:
            self._orphan(answer)
            return
        self.cancel(request_id)
        if self._orphaned is not None and not self.broken:
            now = time.monotonic()
            while self._given_up and next(iter(self._given_up.values())) < now:
                del self._given_up[next(iter(self._given_up))]    # the oldest first: no answer
            self._given_up[request_id] = now + ORPHAN_WAIT_S

    def _orphan(self, answer) -> None:
        if self._orphaned is None:
            return
        try:
            self._orphaned(answer)
        except Exception:  # noqa: BLE001 - one answer's undo must not break the call's reader
            log.exception("undoing an answer whose caller went failed")

    def stream(self, request_id: str, ask: Ask, timeout_s: float, final: Callable[[Answer], bool],
               read: Callable[[Answer], Any]) -> StreamedRequest:
        """`ask`'s answers as a call-like object (StreamedRequest): `final(answer)` says the
        last; `read(answer)` is what the reader gets (None: nothing; it may raise the end)."""
        return self._send(request_id, ask, StreamedRequest(self, request_id, timeout_s, final,
                                                           read))

    def _send(self, request_id: str, ask: Ask, receiver):
        if request_id in self._waiting:
            raise status.CallFailed(status.failed(
                pb.INVALID_REQUEST, f"request id {request_id!r} is already waiting on this call"))
        self._open()
        self._waiting[request_id] = receiver
        self._out.put_nowait(ask)
        return receiver

    def cancel(self, request_id: str) -> None:
        """Tell the peer the request is given up (it undoes what it did for it)."""
        self._waiting.pop(request_id, None)
        if self._out is not None and not self.broken:
            self._out.put_nowait(self._cancel_of(request_id))

    def _open(self) -> None:
        if self._call is not None:
            return
        if time.monotonic() < self._broke_at + self._backoff_s:
            raise status.CallFailed(status.failed(
                pb.UNAVAILABLE, f"the shared call to {self.address} broke "
                f"{time.monotonic() - self._broke_at:.2f} s ago; not reopened yet"),
                untyped_code=grpc.StatusCode.UNAVAILABLE)
        self._out = out = asyncio.Queue()
        self._call = call = self._open_call(_drain(out))
        self.opened += 1
        self._reader = asyncio.get_running_loop().create_task(self._read(call, out))

    async def _read(self, call, out: asyncio.Queue) -> None:
        why: status.CallFailed
        try:
            async for answer in call:
                self._backoff_s = 0.0             # it answers: a later break starts afresh
                rid = self._answer_id(answer)
                receiver = self._waiting.get(rid)
                if receiver is not None and receiver.deliver(answer):
                    del self._waiting[rid]
                elif receiver is None and self._given_up.pop(rid, None) is not None:
                    self._orphan(answer)
            why = status.CallFailed(status.failed(
                pb.UNAVAILABLE, f"{self.address} ended its shared call"),
                untyped_code=grpc.StatusCode.UNAVAILABLE)
        except status.CallFailed as e:
            why = e if e.untyped_code is not None else status.CallFailed(
                e.status, untyped_code=grpc.StatusCode.UNAVAILABLE)
        except asyncio.CancelledError:
            why = status.CallFailed(status.failed(pb.UNAVAILABLE, "the shared call was closed"),
                                    untyped_code=grpc.StatusCode.CANCELLED)
        if self._call is call:
            self._call = None
            self._broke_at = time.monotonic()
            self._backoff_s = min(BACKOFF_S[1], max(BACKOFF_S[0], 2 * self._backoff_s))
        out.put_nowait(None)
        self._given_up.clear()                # their answers cannot come on a new call
        waiting, self._waiting = self._waiting, {}
        for receiver in waiting.values():
            receiver.fail(why)

    async def finish(self, timeout_s: float) -> None:
        """Close once the asks already queued have gone out (a late cancel among them: the peer
        undoes what it gave) and the peer, having answered what ran, ended the call; at most
        `timeout_s`, then as `close`."""
        if self._call is not None and self._reader is not None:
            self._out.put_nowait(None)      # half-close after what is queued
            await asyncio.wait({self._reader}, timeout=timeout_s)
        self.close()

    def close(self) -> None:
        if self._out is not None:
            self._out.put_nowait(None)      # the request iterator ends: grpc's sender task too
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()


async def next_item(queue: asyncio.Queue, deadline: float):
    """The queue's next item, by `deadline` (the loop's clock) or TimeoutError: at once when one
    is there, and with no task of its own otherwise (asyncio.wait_for makes one per call)."""
    if not queue.empty():
        return queue.get_nowait()
    async with asyncio.timeout_at(deadline):
        return await queue.get()


def no_answer(request_id: str, address: str, timeout_s: float) -> status.CallFailed:
    """What a request whose deadline passed on a shared call raises (as a unary call would)."""
    return status.CallFailed(status.failed(
        pb.UNAVAILABLE, f"{request_id}: no answer from {address} within {timeout_s:g} s"),
        untyped_code=grpc.StatusCode.DEADLINE_EXCEEDED)


class _Unary:
    """One request's single answer."""

    def __init__(self) -> None:
        self.future = asyncio.get_running_loop().create_future()

    def deliver(self, answer) -> bool:
        if not self.future.done():
            self.future.set_result(answer)
        return True

    def fail(self, why: Exception) -> None:
        if not self.future.done():
            self.future.set_exception(why)
            self.future.exception()       # retrieved: a caller gone past its deadline is no bug

    def answer(self):
        """The answer delivered, or None (none came, or the call failed)."""
        if self.future.done() and not self.future.cancelled() and not self.future.exception():
            return self.future.result()
        return None


class StreamedRequest:
    """One request's answers on a shared call, read as a streamed call is: `async for` (one
    iterator, resumed where a loop left it), `initial_metadata()` (done once the peer accepted
    it, answered or ended it), `cancel()`. Its deadline is kept here (the call has none)."""

    def __init__(self, shared: SharedCall, request_id: str, timeout_s: float,
                 final: Callable[[Any], bool], read: Callable[[Any], Any]) -> None:
        loop = asyncio.get_running_loop()
        self._shared = shared
        self.request_id = request_id
        self._timeout_s = timeout_s
        self._deadline = loop.time() + timeout_s
        self._final = final
        self._read = read
        self._queue: asyncio.Queue = asyncio.Queue()
        self._heard = loop.create_future()
        self._ended = False

    def deliver(self, answer) -> bool:
        if not self._heard.done():
            self._heard.set_result(None)
        self._queue.put_nowait(answer)
        return self._final(answer)

    def fail(self, why: Exception) -> None:
        if not self._heard.done():
            self._heard.set_result(None)
        self._queue.put_nowait(why)

    async def initial_metadata(self) -> None:
        await asyncio.shield(self._heard)

    def __aiter__(self):
        return self

    async def __anext__(self):
        while True:
            if self._ended and self._queue.empty():
                raise StopAsyncIteration
            try:
                item = await next_item(self._queue, self._deadline)
            except TimeoutError:
                self.cancel()
                raise no_answer(self.request_id, self._shared.address, self._timeout_s) from None
            if isinstance(item, BaseException):
                self._ended = True
                raise item
            if self._final(item):
                self._ended = True
            out = self._read(item)
            if out is not None:
                return out

    def cancel(self) -> bool:
        """Give the request up (the peer ends it); a reader waiting on it ends cancelled."""
        if self._ended:
            return False
        self._ended = True
        self._shared.cancel(self.request_id)
        self._queue.put_nowait(asyncio.CancelledError())
        return True


async def _drain(out: asyncio.Queue):
    while (item := await out.get()) is not None:
        yield item


# ----------------------------------------------------------------------------- the fleet's two

ADMIT: AskShape[pb.AdmitAsk, pb.AdmitAnswer] = AskShape(
    request_id=lambda a: a.request.request_id, call_terms=lambda a: a.terms,
    is_cancel=lambda a: a.cancel,
    answered=lambda rid, plan: pb.AdmitAnswer(request_id=rid, plan=plan),
    failed=lambda rid, st: pb.AdmitAnswer(request_id=rid, failure=st))

PREFILL: AskShape[pb.PrefillAsk, pb.PrefillNote] = AskShape(
    request_id=lambda a: a.request.request_id, call_terms=lambda a: a.terms,
    is_cancel=lambda a: a.cancel,
    answered=lambda rid, _: pb.PrefillNote(request_id=rid, end=True),
    failed=lambda rid, st: pb.PrefillNote(request_id=rid, failure=st),
    accepted=lambda rid: pb.PrefillNote(request_id=rid, accepted=True))

RESERVE: AskShape[pb.ReserveAsk, pb.ReserveAnswer] = AskShape(
    request_id=lambda a: a.request.request_id, call_terms=lambda a: a.terms,
    is_cancel=lambda a: a.cancel,
    answered=lambda rid, resp: pb.ReserveAnswer(request_id=rid, response=resp),
    failed=lambda rid, st: pb.ReserveAnswer(request_id=rid, failure=st))


def admit_call(stub, address: str, orphaned: Callable[[pb.AdmitAnswer], None] | None = None
               ) -> SharedCall[pb.AdmitAsk, pb.AdmitAnswer]:
    """A gateway's shared call to one router (`stub`: a TypedStub of pb_grpc.RouterStub);
    `orphaned(answer)`: an answer whose caller went first (its plan's reservation is held)."""
    return SharedCall(stub.AdmitStream, address, lambda a: a.request_id, lambda rid: pb.AdmitAsk(
        request=pb.WorkRequest(request_id=rid), cancel=True), orphaned)


def reserve_call(stub, address: str) -> SharedCall[pb.ReserveAsk, pb.ReserveAnswer]:
    """A router's shared call to one decode worker (`stub`: a TypedStub of pb_grpc.WorkerStub)."""
    return SharedCall(stub.ReserveStream, address, lambda a: a.request_id,
                      lambda rid: pb.ReserveAsk(request=pb.ReserveRequest(request_id=rid),
                                                cancel=True))


async def _answer(call: SharedCall, request_id: str, ask, timeout_s: float, field: str):
    """Ask over `call` and return the answer's `field`, or raise status.CallFailed as the unary
    call did."""
    answer = await call.ask(request_id, ask, timeout_s)
    if answer.HasField("failure"):
        raise status.CallFailed(answer.failure)
    return getattr(answer, field)


async def admit(call: SharedCall, request: pb.WorkRequest, timeout_s: float,
                metadata: tuple[tuple[str, str], ...] | None = None) -> pb.Plan:
    """Router.Admit over `call`: the plan, or status.CallFailed as the unary call raised."""
    return await _answer(call, request.request_id, pb.AdmitAsk(
        request=request, terms=terms(timeout_s, metadata)), timeout_s, "plan")


async def reserve(call: SharedCall, request: pb.ReserveRequest, timeout_s: float,
                  metadata: tuple[tuple[str, str], ...] | None = None) -> pb.ReserveResponse:
    """Worker.Reserve over `call`, as `admit` is Router.Admit."""
    return await _answer(call, request.request_id, pb.ReserveAsk(
        request=request, terms=terms(timeout_s, metadata)), timeout_s, "response")


def prefill_call(stub, address: str) -> SharedCall[pb.PrefillAsk, pb.PrefillNote]:
    """A gateway's shared call to one prefill worker (`stub`: a TypedStub of pb_grpc.WorkerStub)."""
    return SharedCall(stub.PrefillStream, address, lambda n: n.request_id,
                      lambda rid: pb.PrefillAsk(request=pb.PrefillRequest(request_id=rid),
                                                cancel=True))


def prefill(call: SharedCall, request: pb.PrefillRequest, timeout_s: float,
            metadata: tuple[tuple[str, str], ...] | None = None) -> StreamedRequest:
    """Worker.Prefill over `call`: iterated, the PrefillReplies the call would stream (a failure
    raises status.CallFailed); `initial_metadata()` is done once the worker accepted it."""
    return call.stream(request.request_id, pb.PrefillAsk(
        request=request, terms=terms(timeout_s, metadata)), timeout_s, _prefill_final,
        _prefill_read)


def _prefill_final(note: pb.PrefillNote) -> bool:
    return note.WhichOneof("kind") in ("end", "failure")


def _prefill_read(note: pb.PrefillNote) -> pb.PrefillReply | None:
    kind = note.WhichOneof("kind")
    if kind == "reply":
        return note.reply
    if kind == "end":
        raise StopAsyncIteration
    if kind == "failure":
        raise status.CallFailed(note.failure)
    return None                          # accepted: the headers, nothing to read
