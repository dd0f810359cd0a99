"""A worker's telemetry, seen from outside.

A prefill and a decode worker (each a WorkerServicer over real gRPC on 127.0.0.1, its engine core
a real process on the tiny model, KV over tcp between their pools) serve one disaggregated request
the way the gateway drives it: Reserve on the decode worker, Prefill with the reservation as its
target, then a DecodeStream subscription. Then:
  - a live reservation shows as its tenant's share (WorkerStats.tenants, the tenant gauges);
  - each worker's /metrics (found through WorkerStats.metrics_url) shows the KV it sent or
    received, its steps by phase, its busy time and its KV blocks;
  - the first chunk says how long the request queued and prefilled, the last how long its KV
    moved and it decoded, and those phases fit inside what the client measured;
  - with tracing on (spans kept by an in-memory exporter, InMemorySpanExporter), the prefill,
    kv_transfer and decode spans continue the caller's trace: prefill and decode under the
    traceparent of the Prefill and Reserve calls, kv_transfer under prefill;
  - a co-located (mixed) worker's Generate carries queue_s / prefill_s first and decode_s last,
    in a `generate` span;
  - a worker process started without Redis serves /metrics with its KV blocks.
"""
from __future__ import annotations

import asyncio
import socket
import time

import grpc
import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.engine.engine import StepRecord
from services.engine.scheduler import attention_pairs
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.telemetry import tracing
from tests.harness import Worker, in_process_worker, worker_process
from tests.waiting import eventually
from services.worker.engine_core import StepStats
from services.worker.rates import TINY, WorkerRates
from services.worker.telemetry import CHUNK_TOKENS, WorkerTelemetry
from tests.kv_transfer.conftest import fleet_token_env  # noqa: F401 - the tcp transports' token

PROMPT = [4080, 39, 72, 311, 464, 68] + list(range(600, 660))   # 66 tokens: 5 blocks of 16
MAX_TOKENS = 12
CHUNK = 32                               # the prefill worker computes the prompt in 3 chunks
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
GATEWAY_SPAN = "00f067aa0ba902b7"        # the caller's span on the Prefill call
ROUTER_SPAN = "b7ad6b7169203331"         # the caller's span on the Reserve call


# ------------------------------------------------------------------------------ the rig
def traceparent(span_id: str) -> tuple[tuple[str, str], ...]:
    return (("traceparent", f"00-{CALLER_TRACE}-{span_id}-01"),)


def params() -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


async def disaggregated(prefill: Worker, decode: Worker, rid: str) -> tuple[list[pb.TokenChunk], float]:
    """One request as the gateway runs it: (its chunks in order, the client-measured seconds)."""
    t0 = time.perf_counter()
    reserved = await decode.stub.Reserve(pb.ReserveRequest(
        request_id=rid, tenant="default", traffic_class="interactive", prompt_token_ids=PROMPT,
        params=params()), metadata=traceparent(ROUTER_SPAN), timeout=30)
    assert reserved.accepted, reserved.reason
    chunks = []
    async for reply in prefill.stub.Prefill(pb.PrefillRequest(
            request_id=rid, tenant="default", traffic_class="interactive",
            prompt_token_ids=PROMPT, params=params(), target=reserved.target,
            kv_deadline_unix_s=reserved.expires_at_unix_s),
            metadata=traceparent(GATEWAY_SPAN), timeout=30):
        if reply.HasField("chunk"):
            chunks.append(reply.chunk)
    call = decode.stub.DecodeStream(timeout=30)
    await call.write(pb.DecodeSubscribe(request_id=rid))
    ended = False
    while not ended:
        batch = await call.read()
        chunks.extend(c for c in batch.chunks if c.request_id == rid)
        for end in batch.ends:
            assert end.request_id == rid and not end.HasField("failure"), end
            ended = True
    elapsed = time.perf_counter() - t0
    await call.done_writing()
    call.cancel()
    return chunks, elapsed


# ------------------------------------------------------------------------------ reading /metrics
async def scrape(worker: Worker) -> dict[tuple[str, frozenset], float]:
    """The worker's /metrics, found the way an operator finds it: through its WorkerStats."""
    stats = await worker.stub.Stats(pb.StatsRequest(), timeout=10)
    assert stats.metrics_url.startswith("http://127.0.0.1:")
    text = await asyncio.to_thread(lambda: httpx.get(stats.metrics_url, timeout=10).text)
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


# ------------------------------------------------------------------------------ tracing


# ------------------------------------------------------------------------------ the stories
def test_a_disaggregated_request_shows_in_both_workers_metrics_and_in_its_chunks(tiny_model_dir):
    async def story():
        prefill = await in_process_worker(str(tiny_model_dir), "prefill", chunk_size=CHUNK)
        decode = await in_process_worker(str(tiny_model_dir), "decode")
        try:
            # a reservation is a tenant's share of the decode worker, in its stats and /metrics
            held = await decode.stub.Reserve(pb.ReserveRequest(
                request_id="m-0", tenant="default", prompt_token_ids=PROMPT, params=params()))
            stats = await decode.stub.Stats(pb.StatsRequest())
            assert [(t.tenant, t.sequences, t.kv_blocks) for t in stats.tenants] == \
                [("default", 1, len(held.target.block_ids))]
            samples = await scrape(decode)
            assert value(samples, "kvfleet_tenant_sequences", tenant="default") == 1
            assert value(samples, "kvfleet_tenant_kv_blocks", tenant="default") == 5
            await decode.stub.Cancel(pb.CancelRequest(request_id="m-0"))
            assert value(await scrape(decode), "kvfleet_tenant_sequences", tenant="default") == 0

            chunks, client_s = await disaggregated(prefill, decode, "m-1")
            assert [len(c.token_ids) for c in chunks][:1] == [1]
            assert sum(len(c.token_ids) for c in chunks) == MAX_TOKENS

            # the first chunk (prefill worker): queued, then prefilled; the last (decode
            # worker): the KV's transfer, then the decode; all inside the client's time
            first, last = chunks[0].timing, chunks[-1].timing
            assert first.queue_s > 0 and first.prefill_s > 0
            assert last.transfer_s > 0 and last.decode_s > 0
            assert first.queue_s + first.prefill_s + last.transfer_s + last.decode_s <= client_s

            sent, received = await scrape(prefill), await scrape(decode)
            kv_bytes = 5 * decode.transport.descriptor([0]).bytes_per_block
            assert value(sent, "kvfleet_kv_transfer_bytes_total", direction="sent",
                         backend="tcp") == kv_bytes
            assert value(received, "kvfleet_kv_transfer_bytes_total", direction="received",
                         backend="tcp") == kv_bytes
            assert value(sent, "kvfleet_kv_transfer_seconds_count", role="prefill") == 1
            # the prompt was computed in chunks on the prefill worker, tokens 2..N on the decode one
            assert value(sent, "kvfleet_iteration_tokens_count", phase="prefill") == 3
            assert value(sent, "kvfleet_tokens_total", phase="prefill") == len(PROMPT)
            assert value(received, "kvfleet_iteration_tokens_count", phase="decode") >= MAX_TOKENS - 1
            assert value(sent, "kvfleet_busy_seconds_total", phase="prefill") > 0
            assert value(received, "kvfleet_busy_seconds_total", phase="decode") > 0
            assert value(sent, "kvfleet_request_queue_seconds_count") == 1
            for samples in (sent, received):
                assert value(samples, "kvfleet_kv_blocks", state="total") > 0
            assert value(sent, "kvfleet_worker_requests_total", outcome="handed_off") == 1
            assert value(received, "kvfleet_worker_requests_total", outcome="finished") == 1
            assert value(received, "kvfleet_worker_requests_total", outcome="cancelled") == 1
        finally:
            await prefill.close()
            await decode.close()
    asyncio.run(story())


def test_prefill_kv_transfer_and_decode_spans_continue_the_callers_trace(tiny_model_dir,
                                                                         in_memory_spans):
    async def story():
        prefill = await in_process_worker(str(tiny_model_dir), "prefill", chunk_size=CHUNK)
        decode = await in_process_worker(str(tiny_model_dir), "decode")
        try:
            await disaggregated(prefill, decode, "t-1")
            names = ("prefill", "kv_transfer", "decode")
            assert await eventually(lambda: {s.name for s in in_memory_spans.get_finished_spans()} >= set(names))
        finally:
            await prefill.close()
            await decode.close()
        by_name = {s.name: s for s in in_memory_spans.get_finished_spans()
                   if s.attributes.get(tracing.REQUEST_ID) == "t-1"}
        p, kv, d = (by_name[n] for n in names)

        # one trace, the caller's; prefill under the Prefill call, decode under the Reserve call,
        # the KV write under prefill
        for s in (p, kv, d):
            assert format(s.context.trace_id, "032x") == CALLER_TRACE
        assert format(p.parent.span_id, "016x") == GATEWAY_SPAN
        assert format(d.parent.span_id, "016x") == ROUTER_SPAN
        assert kv.parent.span_id == p.context.span_id

        # in order: prefill to the first token, then the write, then decode from the landing
        # (which the decode worker may see before the writer has the target's last reply)
        assert p.end_time <= kv.start_time < d.start_time < d.end_time
        assert kv.start_time < kv.end_time
        assert [e.attributes[CHUNK_TOKENS] for e in p.events if e.name == "chunk"] == [32, 32, 2]
        assert kv.attributes[tracing.KV_BYTES] > 0 and kv.attributes[tracing.KV_BACKEND] == "tcp"
        assert kv.attributes[tracing.KV_CHECKSUM] == "off"
        assert d.attributes[tracing.OUTPUT_TOKENS] == MAX_TOKENS
        assert d.attributes[tracing.FINISH_REASONS] == ("length",)
        assert d.attributes[tracing.QUEUE_WAIT] > 0
        for s in (p, kv, d):
            assert s.attributes[tracing.TENANT] == "default"
            assert s.attributes[tracing.TRAFFIC_CLASS] == "interactive"
            assert s.attributes[tracing.INPUT_TOKENS] == len(PROMPT)
            assert s.attributes[tracing.REQUEST_MODEL]
        assert p.attributes[tracing.REPLICA] == "prefill-0" and d.attributes[tracing.REPLICA] == "decode-0"
    asyncio.run(story())


def test_a_mixed_worker_times_queue_prefill_and_decode_in_a_generate_span(tiny_model_dir,
                                                                         in_memory_spans):
    async def story():
        mixed = await in_process_worker(str(tiny_model_dir), "mixed")
        try:
            t0 = time.perf_counter()
            chunks = [c async for c in mixed.stub.Generate(pb.WorkRequest(
                request_id="g-1", tenant="default", traffic_class="interactive",
                prompt_token_ids=PROMPT, params=params()),
                metadata=traceparent(GATEWAY_SPAN), timeout=30)]
            client_s = time.perf_counter() - t0
            samples = await scrape(mixed)
        finally:
            await mixed.close()
        first, last = chunks[0].timing, chunks[-1].timing
        assert first.queue_s > 0 and first.prefill_s > 0 and last.decode_s > 0
        assert first.queue_s + first.prefill_s + last.decode_s <= client_s
        assert value(samples, "kvfleet_worker_requests_total", outcome="finished") == 1
        assert value(samples, "kvfleet_tokens_total", phase="prefill") == len(PROMPT)

        (g,) = [s for s in in_memory_spans.get_finished_spans() if s.name == "generate"]
        assert format(g.parent.span_id, "016x") == GATEWAY_SPAN
        assert g.attributes[tracing.OUTPUT_TOKENS] == MAX_TOKENS
        assert [e.name for e in g.events].count("first_token") == 1
    asyncio.run(story())


def test_a_worker_process_without_redis_keeps_its_metrics_fresh(tiny_model_dir, tmp_path):
    """No Redis, so no heartbeat: its gauges are refreshed on the heartbeat's period anyway,
    before anyone calls Stats; Stats then names the same /metrics."""
    port = free_port()
    with open(tmp_path / "worker.stderr", "w+") as stderr, worker_process(
            tiny_model_dir, "prefill", "--kv-cache-mib", "16", "--metrics-port", str(port),
            stderr=stderr) as (_, address):
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 10
        while not (total := blocks_total(httpx.get(url, timeout=10).text)):
            assert time.monotonic() < deadline, "the gauges were never refreshed"
            time.sleep(0.05)
        with grpc.insecure_channel(address) as channel:
            stats = pb_grpc.WorkerStub(channel).Stats(pb.StatsRequest(), timeout=10)
        assert stats.metrics_url == url
        assert total == stats.kv_blocks_total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def blocks_total(text: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvfleet_kv_blocks" and s.labels["state"] == "total")


def test_a_kv_moving_worker_exports_its_failure_series_at_zero_from_the_start():
    # so that Prometheus's rate() sees the first failure (a counter born at 1 shows no increase)
    telemetry = WorkerTelemetry("prefill", "p-zero")
    telemetry.expect_kv("tcp")
    registry = telemetry.metrics.registry
    labels = {"role": "prefill", "worker": "p-zero", "backend": "tcp"}
    for reason in ("timeout", "deadline", "peer_gone", "other"):
        assert registry.get_sample_value("kvfleet_kv_transfer_failures_total",
                                         {**labels, "reason": reason}) == 0.0
    assert registry.get_sample_value("kvfleet_kv_transfer_bytes_total",
                                     {**labels, "direction": "sent"}) == 0.0


def test_a_step_deep_in_a_prompt_reaches_the_published_rates_timed_at_depth_0():
    """The engine core's step record names its chunks (request, tokens) and its decodes' context
    (the KV bytes they read); the telemetry hands the rates the pairs the step would have had at
    position 0, so a document chunk 8K tokens deep and a decode over 1K tokens of context enter
    the recent step as the fit prices that shallower step."""
    telemetry = WorkerTelemetry("mixed", "m-deep")
    telemetry.rates = WorkerRates(TINY, kv_bytes_per_token=2048)
    deep = attention_pairs(8192, 512) + 1024
    shallow = attention_pairs(0, 512) + 1024
    telemetry.on_step(StepStats(prefill_tokens=512, decode_tokens=1, num_prefill_seqs=1,
                                num_decode_seqs=1, duration_s=TINY.step_time(513, deep),
                                gap_s=0.0, kv_read_bytes=1024 * 2048, prefix_queries=0,
                                prefix_hits=0, preemptions=0, prefill_chunks=[("doc", 512)],
                                attention_pairs=deep))
    assert telemetry.rates.fields()["prefill_recent_step_s"] == pytest.approx(
        TINY.step_time(513, shallow), rel=0.01)


def test_a_core_steps_classes_reach_the_published_arrival_rates_by_class():
    """The core's step record on the wire (StepStats.of) carries its prefill tokens by class; the
    telemetry hands them to the rates, which publish each class's tokens and prompts per second."""
    telemetry = WorkerTelemetry("mixed", "m-classes")
    telemetry.rates = WorkerRates(TINY, kv_bytes_per_token=2048)
    record = StepRecord(prefill_tokens=96, decode_tokens=0, num_prefill_seqs=2, num_decode_seqs=0,
                        duration_s=0.05, gap_s=0.0, kv_read_bytes=0, prefix_queries=0,
                        prefix_hits=0, preemptions=0, prefill_chunks=[("c", 64), ("d", 32)],
                        attention_pairs=attention_pairs(0, 64) + attention_pairs(0, 32),
                        prefill_by_class={"interactive": 64, "document": 32},
                        prompts_by_class={"interactive": 1.0, "document": 0.25})
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(StepStats.of(record)), type=StepStats)
    telemetry.on_step(wire)

    fields = telemetry.rates.fields()
    tokens = fields["prefill_tokens_per_wall_s_by_class"]
    prompts = fields["prefill_prompts_per_wall_s_by_class"]
    assert set(tokens) == set(prompts) == {"interactive", "document"}
    assert tokens["interactive"] == pytest.approx(2 * tokens["document"])
    assert prompts["interactive"] == pytest.approx(4 * prompts["document"])
