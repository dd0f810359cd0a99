"""`python -m services.router --redis-url URL [--mode disagg|colocated|hybrid] [--placement prefix|load]
[--port P] [--router-id ID] [--config ENGINE_YAML] [--metrics-port P] [--timeout-*-s S ...]
[--fleet-token-file PATH | --insecure-internal]`.

--config: the engine config the workers run (its classes' TTFT targets and `degradable`, its
tenants' `critical` and `min_kv_blocks`, its `max_running`) is what admission judges by
(services/router/admission.py); without it, the defaults of services/engine/config.py.

Several routers may serve one fleet: they keep nothing of their own that matters (all of it is in
Redis), so the gateway may ask any of them.

Serves Prometheus /metrics on 127.0.0.1:--metrics-port (0, the default: a free port; -1: none),
traces when the OTEL_* environment names an OTLP endpoint (services/telemetry/tracing.py), and
heartbeats its ServiceRecord (role router, its gRPC address and metrics URL) into Redis for
`kvfleet status` and Prometheus discovery.

Serves only callers with the fleet token (services/protocol/fleet_token.py; without one it refuses
to start). Prints `READY router <host:port>` once serving; SIGTERM / SIGINT stop it."""
import argparse
import asyncio
import logging

import grpc

from services.protocol import bind, fleet_token, timeouts
from services.protocol.aio import run, setup_logging
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.standard_health import add_standard_health

from services.state.fleet_state import FleetState
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.shutdown import exit_now, wait_for_stop_signal
from services.router.paths import DEFAULT_THRESHOLD_TOKENS, MODES
from services.router.prefix_index import KVEventFeed, PrefixIndex
from services.engine.config import SchedulerConfig
from services.engine.config_file import load_engine_config
from services.router.admission import AdmissionConfig
from services.router.service import RouterServicer
from services.state.service_heartbeat import beat_forever, service_record, stop_beating
from services.telemetry import exposition, tracing

log = logging.getLogger("services.router")


async def serve(args: argparse.Namespace) -> int:
    bind.check(args.host, args.allow_external_bind, "the router")
    setup_logging("router")
    limits = timeouts.from_args(args)
    auth = fleet_token.configure(args, "router")
    tracing.setup("router", args.router_id)
    state = FleetState(args.redis_url)
    index = PrefixIndex() if args.placement == "prefix" else None
    servicer = RouterServicer(state, args.mode, args.router_id, limits, prefix_index=index,
                              policy=admission_config(args.config),
                              hybrid_threshold_tokens=args.hybrid_threshold_tokens)
    servicer.start()
    feed = asyncio.create_task(KVEventFeed(state, index).run()) if index is not None else None
    metrics = exposition.serve(servicer.metrics.registry, args.metrics_port, args.host,
                               external=args.allow_external_bind)
    server = grpc.aio.server(interceptors=fleet_token.server_interceptors(auth))
    pb_grpc.add_RouterServicer_to_server(servicer, server)
    probe = add_standard_health(server, pb.DESCRIPTOR.services_by_name["Router"].full_name,
                                servicer.Health)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    probe.start()
    record = service_record(args.router_id, "router", f"{args.host}:{port}",
                            metrics.url if metrics else "")
    beat = asyncio.create_task(beat_forever(state, record, limits.heartbeat_s,
                                            limits.heartbeat_ttl_s, log))
    watch = asyncio.create_task(servicer.watch_workers(limits.heartbeat_s))
    if metrics:
        print(f"METRICS router {metrics.url}", flush=True)
    print(f"READY router {args.host}:{port}", flush=True)
    await wait_for_stop_signal()
    await probe.close()           # NOT_SERVING before anything stops
    watch.cancel()
    if feed is not None:
        feed.cancel()
    await stop_beating(beat, state, args.router_id, log)
    await server.stop(grace=limits.shutdown_grace_s)
    await servicer.close()
    await state.close()
    # the /metrics thread is a daemon and ends with the process (its shutdown() would wait out
    # a 0.5-s poll of the 3-s stop budget); tracing flushes its last spans at exit
    return 0


def admission_config(path: str | None) -> AdmissionConfig:
    scheduler = load_engine_config(path).scheduler if path else SchedulerConfig()
    try:
        return AdmissionConfig(classes=scheduler.classes, tenants=scheduler.tenants,
                               max_running=scheduler.max_running)
    except ValueError as e:
        raise SystemExit(f"{path}: {e}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvfleet router")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--mode", choices=MODES, default="disagg",
                   help="disagg, colocated, or hybrid: prompts of at most "
                        "--hybrid-threshold-tokens co-located, longer ones disaggregated")
    p.add_argument("--hybrid-threshold-tokens", type=int, default=DEFAULT_THRESHOLD_TOKENS,
                   metavar="N", help="hybrid: the longest prompt served co-located (default "
                   f"{DEFAULT_THRESHOLD_TOKENS}; `kvfleet up` sets it from the capacity model)")
    p.add_argument("--host", default="127.0.0.1")
    bind.add_args(p)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--router-id", default="router")
    p.add_argument("--placement", choices=["prefix", "load"], default="prefix",
                   help="prefix (default): prefill / mixed workers holding the prompt's prefix "
                        "win by the work they save (the workers' KV events); load: by load alone")
    p.add_argument("--config", default=None,
                   help="engine config YAML: the classes and tenants admission judges by")
    exposition.add_args(p)
    timeouts.add_args(p)
    fleet_token.add_args(p)
    args = p.parse_args(argv)
    if args.hybrid_threshold_tokens < 1:
        p.error(f"--hybrid-threshold-tokens must be at least 1; got {args.hybrid_threshold_tokens}")
    return run(serve(args))


if __name__ == "__main__":
    exit_now(main())                   # stopped and closed: no interpreter teardown
