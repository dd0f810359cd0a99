"""A test double of a Router, named as one: a real gRPC server on 127.0.0.1 that records every
WorkRequest a gateway sends to Router.Admit, refuses the next `refusals[class]` requests of a class
as the router refuses a request that would miss its TTFT target (OVERLOADED, with a retry hint),
and forwards everything else to the fleet's real router. The gateway asks on AdmitStream (one
long-lived call, services/protocol/shared_call.py): each ask is answered by a thread of its own,
so asks wait on the real router side by side as they do on a real router.

A slow way back, on demand: while `hold` is set, each plan the real router made (its decode
reservation held) waits here, in `holding`, until `release(request_id)`, as an answer does on a
slow network. It records the asks whose gateway cancelled them (`cancelled`) and the plans it
sent on (`answered`)."""
from __future__ import annotations

import collections
import queue
import threading
from concurrent import futures

import grpc

from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from tests.harness import Fleet


class RouterProxy(pb_grpc.RouterServicer):
    def __init__(self, fleet: Fleet, retry_after_s: float = 0.2) -> None:
        self.retry_after_s = retry_after_s
        self.received: list[pb.WorkRequest] = []
        self.refusals: collections.Counter[str] = collections.Counter()   # class -> to refuse
        self.hold = False
        self.holding: dict[str, threading.Event] = {}    # request id -> its plan's release
        self.cancelled: set[str] = set()
        self.answered: set[str] = set()
        self._lock = threading.Lock()
        self._channel = fleet.channel(fleet.router)
        self._router = pb_grpc.RouterStub(self._channel)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_RouterServicer_to_server(self, self._server)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"

    def classes(self) -> list[str]:
        with self._lock:
            return [r.traffic_class for r in self.received]

    def Admit(self, request: pb.WorkRequest, context) -> pb.Plan:
        refusal = self._refusal(request)
        if refusal is not None:
            context.set_trailing_metadata(status.trailing(refusal))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message)
        return self._router.Admit(request, timeout=10)

    def AdmitStream(self, asks, context):
        answers: queue.Queue[pb.AdmitAnswer | None] = queue.Queue()
        left = [1]                       # asks still unanswered, plus the reader until it ends

        def done(answer: pb.AdmitAnswer | None) -> None:
            if answer is not None:
                answers.put(answer)
            with self._lock:
                left[0] -= 1
                if not left[0]:
                    answers.put(None)

        def one(ask: pb.AdmitAsk) -> None:
            rid = ask.request.request_id
            refusal = self._refusal(ask.request)
            if refusal is not None:
                return done(pb.AdmitAnswer(request_id=rid, failure=refusal))
            try:
                plan = self._router.Admit(ask.request, timeout=10)
            except grpc.RpcError as e:
                return done(pb.AdmitAnswer(request_id=rid, failure=status.of(e)))
            self._held(rid)
            with self._lock:
                self.answered.add(rid)
            done(pb.AdmitAnswer(request_id=rid, plan=plan))

        def read() -> None:
            try:
                for ask in asks:
                    if ask.cancel:
                        with self._lock:
                            self.cancelled.add(ask.request.request_id)
                    else:
                        with self._lock:
                            left[0] += 1
                        threading.Thread(target=one, args=(ask,), daemon=True).start()
            except grpc.RpcError:
                pass                     # the caller went away, or the server stopped: asks end
            finally:
                done(None)               # else the answers' loop below waits forever, and the
                                         # interpreter's exit joins its server thread forever

        threading.Thread(target=read, daemon=True).start()
        while (answer := answers.get()) is not None:
            yield answer

    def _held(self, rid: str) -> None:
        """While `hold` is set: wait for `release(rid)` (at most a minute)."""
        with self._lock:
            if not self.hold:
                return
            released = self.holding[rid] = threading.Event()
        released.wait(60)

    def release(self, rid: str) -> None:
        with self._lock:
            self.holding.pop(rid).set()

    def release_all(self) -> None:
        with self._lock:
            self.hold = False
            held, self.holding = list(self.holding.values()), {}
        for released in held:
            released.set()

    def _refusal(self, request: pb.WorkRequest) -> pb.CallStatus | None:
        """Records the request; the refusal it gets here, if its class has refusals left."""
        with self._lock:
            self.received.append(request)
            refuse = self.refusals[request.traffic_class] > 0
            self.refusals[request.traffic_class] -= refuse
        if not refuse:
            return None
        return status.failed(pb.OVERLOADED, "predicted TTFT misses the document target",
                             retry_after_s=self.retry_after_s)

    def Health(self, request, context) -> pb.HealthResponse:
        return self._router.Health(request, timeout=5)

    def __enter__(self) -> RouterProxy:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release_all()
        self._server.stop(0).wait(5)
        self._channel.close()
