"""An OTLP/gRPC trace receiver on loopback: the official `opentelemetry-proto` TraceService, the
protocol Jaeger and Tempo speak. Tests check the fleet's traces with it, and `kvfleet bench
telemetry` gives the fleet's exporters somewhere real to send to; it keeps the spans in memory.

    with OtlpReceiver() as rx:                     # serves on 127.0.0.1:<free port>
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, ...}
        ...
        spans = rx.wait_for(lambda spans: ..., timeout_s=10)
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as ts_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class Span:
    """One received span, flattened: ids in hex, times in unix nanoseconds."""
    trace_id: str
    span_id: str
    parent_span_id: str              # "" for a root span
    name: str
    service: str                     # the resource's service.name
    instance: str                    # the resource's service.instance.id
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    events: tuple[tuple[str, dict], ...] = ()
    status_code: int = 0             # 0 unset, 1 ok, 2 error

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: common_pb2.AnyValue):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class _TraceService(ts_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpReceiver) -> None:
        self._sink = sink

    def Export(self, request: ts_pb2.ExportTraceServiceRequest, context):
        got = []
        for rs in request.resource_spans:
            res = _attrs(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), name=s.name,
                        service=str(res.get("service.name", "")),
                        instance=str(res.get("service.instance.id", "")),
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        events=tuple((e.name, _attrs(e.attributes)) for e in s.events),
                        status_code=s.status.code))
        self._sink._add(got)
        return ts_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        ts_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"http://{host}:{self.port}"
        self._spans: list[Span] = []
        self._changed = threading.Condition()

    def start(self) -> OtlpReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _add(self, spans: list[Span]) -> None:
        with self._changed:
            self._spans.extend(spans)
            self._changed.notify_all()

    def spans(self) -> list[Span]:
        with self._changed:
            return list(self._spans)

    def clear(self) -> None:
        with self._changed:
            self._spans.clear()

    def wait_for(self, done: Callable[[list[Span]], bool], timeout_s: float) -> list[Span]:
        """The spans received so far, once `done(spans)` holds; TimeoutError naming what arrived
        if it does not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not done(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({f"{s.service}/{s.name}" for s in self._spans})
                    raise TimeoutError(f"spans not complete within {timeout_s} s; received "
                                       f"{len(self._spans)}: {names}")
                self._changed.wait(left)
            return list(self._spans)

    @staticmethod
    def env(endpoint: str, ratio: float = 1.0, fast: bool = True) -> dict[str, str]:
        """The environment that points a kvfleet process's exporter here. `fast`: export every
        200 ms (tests wait less); else the SDK's default batching (every 5 s), as in production."""
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_TRACES_SAMPLER_ARG": str(ratio)}
        return {**env, "OTEL_BSP_SCHEDULE_DELAY": "200"} if fast else env
