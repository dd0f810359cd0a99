"""Assemble and run the gateway: the model's tokenizer, quotas (Redis) and their lease renewer, a
router channel, the gRPC server, then the HTTP server; print `GRPC <addr>` and `READY gateway <addr>`;
stop on a signal.

Each gateway process has an id (`gateway_id()`), the prefix of the stream-slot leases it holds
(services/gateway/quota.py). The lease terms are the fleet's `Timeouts.lease_ttl_s` (default 10 s:
the longest a dead gateway's slots stay taken) and `lease_renew_s` (default 2 s), from the flags
`--timeout-lease-ttl-s` / `--timeout-lease-renew-s`.

Telemetry: traces are set up for the process (`tracing.setup`, on when OTEL_* names an
endpoint); `/metrics` is on the HTTP app. The gateway registers itself in Redis as a
`pb.ServiceRecord` (role gateway, its HTTP address and metrics URL) every `heartbeat_s`, each beat
living `heartbeat_ttl_s` (services/state/service_heartbeat.py: Redis down is retried with
backoff, never fatal), and takes the record out at shutdown.

Asynchronous jobs (services/gateway/jobs.py) are leased like stream slots: TTL
`--job-lease-s` (default 10 s), renewed every TTL/3; at shutdown they are stopped and
their leases let go, so another gateway (or this one restarted) resumes them.

Shutdown: stop taking connections, end every live request as aborted (their quota slots are
released), let the servers drain for a moment, stop renewing leases, close the channels.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid

import grpc
import uvicorn

from services.protocol.shutdown import wait_for_stop_signal
from services.protocol import fleet_token
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.standard_health import add_standard_health
from services.protocol.timeouts import Timeouts
from services.state.fleet_state import FleetState, LeaseTerms
from services.state.service_heartbeat import beat_forever, service_record, stop_beating
from services.telemetry import tracing
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.core import GatewayCore
from services.gateway.fleet_run import Channels
from services.gateway.grpc_api import GatewayServicer, add_to_server
from services.gateway.model import load_served_model
from services.gateway.jobs import JobRunner
from services.gateway.quota import Quotas
from services.state.jobs import JobStore

log = logging.getLogger(__name__)

def gateway_id() -> str:
    """Unique per process start: a restarted gateway never renews its predecessor's leases."""
    return f"gw-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def lease_terms(timeouts: Timeouts) -> LeaseTerms:
    """The stream-slot lease terms: the fleet's timeouts (checked at start)."""
    return LeaseTerms(ttl_s=timeouts.lease_ttl_s, renew_every_s=timeouts.lease_renew_s)


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: this process owns SIGTERM / SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit TCP_NODELAY: without it a keep-alive response written as
    # headers + body waits for the client's delayed ACK (Nagle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def serve(config: GatewayConfig, timeouts: Timeouts | None = None) -> int:
    timeouts = timeouts or Timeouts()
    model = load_served_model(config.model_dir, config.served_model_name, config.max_model_len,
                              config.quality_version, config.served_model_aliases)
    state = FleetState(config.redis_url)
    # its calls to routers and workers carry the fleet token: without one, refuse to start
    channels = Channels(fleet_token.active().require("gateway"), timeouts.cancel_s)
    quotas = Quotas(state, gateway_id(), lease_terms(timeouts))
    tracing.setup("gateway", quotas.holder)
    core = GatewayCore(config, model, quotas, channels, timeouts)
    renewer = asyncio.create_task(quotas.renew_forever())
    jobs = JobRunner(core, JobStore.connect(config.redis_url), quotas.holder,
                     config.job_lease_s)
    job_leases = asyncio.create_task(jobs.maintain_forever())

    grpc_server = grpc.aio.server()
    gateway = GatewayServicer(core)
    add_to_server(gateway, grpc_server)
    probe = add_standard_health(grpc_server, pb.DESCRIPTOR.services_by_name["Gateway"].full_name,
                                gateway.Health)
    grpc_port = grpc_server.add_insecure_port(host_port(config.host, config.grpc_port))
    await grpc_server.start()
    probe.start()

    sock = bind(config.host, config.http_port)
    # proxy_headers off: no proxy is trusted, so X-Forwarded-* must not rewrite the client address
    http = _HttpServer(uvicorn.Config(create_app(core, jobs), lifespan="off", log_level="warning",
                                      access_log=False, server_header=False, proxy_headers=False,
                                      timeout_graceful_shutdown=timeouts.shutdown_grace_s))
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    while not http.started:       # uvicorn has no started event: poll its flag
        if http_task.done():
            http_task.result()
            raise RuntimeError("the HTTP server stopped while starting")
        await asyncio.sleep(0.01)
    http_address = host_port(config.host, sock.getsockname()[1])
    beat = asyncio.create_task(beat_forever(
        state, service_record(quotas.holder, "gateway", http_address,
                              f"http://{http_address}/metrics"),
        timeouts.heartbeat_s, timeouts.heartbeat_ttl_s, log))
    print(f"GRPC {host_port(config.host, grpc_port)}", flush=True)
    print(f"READY gateway {http_address}", flush=True)
    log.info("serving %s (%s) with router %s; gateway id %s, stream leases %s", model.name,
             model.quality_version, config.router, quotas.holder, quotas.terms)

    await wait_for_stop_signal()
    await probe.close()           # NOT_SERVING before anything stops
    http.should_exit = True
    job_leases.cancel()
    await jobs.close()            # their leases lapse now: another gateway resumes them
    await core.close()
    await asyncio.gather(grpc_server.stop(grace=timeouts.shutdown_grace_s), http_task, return_exceptions=True)
    await core.close()            # releases of requests that ended during the drain
    renewer.cancel()
    await asyncio.gather(renewer, return_exceptions=True)
    await stop_beating(beat, state, quotas.holder, log)
    await channels.close()
    await jobs.store.close()
    await state.close()
    return 0
