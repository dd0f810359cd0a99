"""One worker, assembled: `build_worker(config, role)` -> a Worker to start and stop.

start(): the engine core process (engine_client.py; a real engine's core measures its warm-up
profile before it is ready) and the cost prior it publishes (rates.py, fitted to that profile),
/metrics when config.metrics_port says so, the KV transport when the role moves KV (registered on
the engine's pool; a simulated core's writes paced to its target's link), the role started with
those parts (role.py), the gRPC server on config.host:port with the standard health probe, and,
with a Redis URL, the heartbeat, the KV event publisher and the capacity notifier. Without Redis
the heartbeat still runs when /metrics is served (it refreshes the gauges).

stop(): NOT_SERVING first, the background tasks cancelled, the Redis record removed, the role
stopped (its open calls end), the server stopped within shutdown_grace_s, the transport and the
engine core closed. The engine core dying sets `engine_failed` (the process entry stops on it).

The worker knows no role by name: the process entry (services/cli/serve_cmd.py) or a test passes
one in.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import grpc
from redis.exceptions import RedisError

from services.engine.config import EngineConfig
from services.protocol import bind, fleet_token
from services.protocol.fleet_token import FleetAuth
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.standard_health import StandardHealth, add_standard_health
from services.state.fleet_state import FleetState
from services.state.wait_queue import WaitQueue
from services.telemetry import exposition
from services.worker.capacity import CapacityNotifier
from services.worker.config import WorkerConfig, warmup_margin
from services.worker.engine_client import EngineClient
from services.worker.heartbeat import heartbeat_forever
from services.worker.kv_events import KVEventPublisher, PublisherConfig
from services.worker.rates import (WorkerRates, default_prior, prior_for, prior_from_steps,
                                   prior_from_timer)
from services.worker.role import Role, RoleParts
from services.worker.servicer import WorkerServicer
from services.worker.telemetry import WorkerTelemetry

log = logging.getLogger(__name__)


def build_worker(config: WorkerConfig, role: Role, auth: FleetAuth | None = None) -> "Worker":
    """The worker `config` describes, serving `role` (whose name must be config.role); `auth`:
    the fleet token its server requires (None: none)."""
    if not isinstance(role, Role):
        raise TypeError(f"build_worker needs a Role (services/worker/role.py), got "
                        f"{type(role).__name__}")
    if role.name != config.role:
        raise ValueError(f"worker {config.worker_id} is configured as {config.role!r} but was "
                         f"given the {role.name!r} role")
    return Worker(config, role, auth)


class Worker:
    def __init__(self, config: WorkerConfig, role: Role, auth: FleetAuth | None) -> None:
        self.config, self.role, self.auth = config, role, auth
        self.telemetry = WorkerTelemetry(config.role, config.worker_id)
        self.engine_failed = asyncio.Event()      # the engine core died (engine.failure says why)
        self.engine = EngineClient(config.engine, on_failure=lambda _: self.engine_failed.set(),
                                   on_step=self.telemetry.on_step,
                                   torch_threads=config.torch_threads,
                                   warmup_timeout_s=config.warmup_timeout_s)
        self.transport = None          # the KV transport, for a role that moves KV
        self.capacity = CapacityNotifier(None)    # publishes once there is a Redis
        self.servicer: WorkerServicer | None = None
        self.server: grpc.aio.Server | None = None
        self.probe: StandardHealth | None = None
        self.state: FleetState | None = None
        self.metrics: exposition.MetricsServer | None = None
        self.address = ""              # host:port, once serving
        self.beat: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []      # KV events, capacity notifications

    async def start(self) -> None:
        """Everything up and serving; what started is stopped again when a later step fails."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        config, telemetry = self.config, self.telemetry
        await self.engine.start()
        telemetry.rates = _rates(config, self.engine)
        self.metrics = exposition.serve(
            telemetry.metrics.registry, config.metrics_port,
            bind.metrics_host(config.host, config.allow_external_bind),
            external=config.allow_external_bind)
        if self.metrics is not None:
            telemetry.metrics_url = self.metrics.url
        if self.role.moves_kv:
            self.transport = _transport(config, self.engine)
            telemetry.expect_kv(config.kv_backend)
            self.transport.register(self.engine.kv_cache)
        parts = RoleParts(config, self.engine, self.transport, telemetry, self.capacity)
        await self.role.start(parts)
        self.servicer = WorkerServicer(parts, self.role)
        await self._serve_grpc()
        self._start_background()

    async def _serve_grpc(self) -> None:
        interceptors = fleet_token.server_interceptors(self.auth) if self.auth else []
        self.server = grpc.aio.server(interceptors=interceptors)
        pb_grpc.add_WorkerServicer_to_server(self.servicer, self.server)
        self.probe = add_standard_health(
            self.server, pb.DESCRIPTOR.services_by_name["Worker"].full_name, self.servicer.Health)
        port = self.server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        await self.server.start()
        self.probe.start()
        self.address = self.servicer.address = f"{self.config.host}:{port}"

    def _start_background(self) -> None:
        config = self.config
        if config.redis_url:
            self.state = FleetState(config.redis_url)
        if self.state is not None or self.telemetry.metrics_url:
            self.beat = asyncio.create_task(heartbeat_forever(self.state, self.servicer))
        if self.state is None:
            return
        self._tasks.append(asyncio.create_task(KVEventPublisher(
            PublisherConfig(config.worker_id, self.engine.block_size, config.timeouts.heartbeat_s),
            self.engine.kv_events).run(self.state)))
        self.capacity.queue = WaitQueue(self.state.redis, self.state.ns)
        self._tasks.append(asyncio.create_task(self.capacity.run()))

    async def leave(self) -> None:
        """Out of the fleet, still serving what it holds (a drain): the standard health probe
        says NOT_SERVING, the heartbeat stops (a beat in flight lands first), the Redis record
        goes."""
        if self.probe is not None:
            await self.probe.stopping()
        if self.beat is not None:
            self.beat.cancel()
            await asyncio.gather(self.beat, return_exceptions=True)
        if self.state is not None:
            await self.state.remove_worker(self.config.worker_id)

    async def stop(self, exiting: bool = False) -> None:
        """Stop everything started (idempotent). `exiting`: the process ends right after, so
        /metrics (a daemon thread) is left to the exit: closing it waits out its poll interval
        inside the stop budget."""
        if self.probe is not None:
            await self.probe.close()                 # NOT_SERVING before anything stops
        for task in (self.beat, *self._tasks):
            if task is not None:
                task.cancel()
        self.beat, self._tasks = None, []
        await self._leave_redis()
        self.role.stop()
        if self.server is not None:
            await self.server.stop(grace=self.config.timeouts.shutdown_grace_s)
            self.server = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.metrics is not None and not exiting:
            self.metrics.close()
            self.metrics = None
        await self.engine.close()

    async def _leave_redis(self) -> None:
        if self.state is None:
            return
        try:
            await self.state.remove_worker(self.config.worker_id)
        except RedisError as e:            # Redis down: the record expires with its TTL anyway
            log.warning("could not remove worker %s from Redis at shutdown: %s",
                        self.config.worker_id, e)
        await self.state.close()
        self.state = None

    async def __aenter__(self) -> "Worker":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()


def _rates(config: WorkerConfig, engine: EngineClient) -> WorkerRates:
    """The rates this worker publishes, starting from its prior costs (_prior)."""
    kv_bytes_per_token = engine.kv_cache.bytes_per_block // engine.block_size
    sched = config.engine.scheduler
    prior = _prior(config.engine, config.step_profile, kv_bytes_per_token, sched.token_budget,
                   engine.warmup, warmup_margin(config.warmup_margin, engine.kv_device))
    log.info("worker %s: cost prior %s: %.3g s a step + %.3g s a token + %.3g s a pair",
             config.worker_id, prior.source, prior.step_s, prior.s_per_token, prior.s_per_pair)
    return WorkerRates(prior, token_budget=sched.token_budget, chunk_size=sched.chunk_size,
                       kv_bytes_per_token=kv_bytes_per_token)


def _prior(engine_config: EngineConfig, profile: str | None, kv_bytes_per_token: int,
           budget: int, warmup=None, margin: float = 1.0):
    """What this worker publishes as its costs before it has measured any (rates.py's module
    docstring, the order): --step-profile, else a simulated engine's own step timer (its
    target's cost model, profile or fixed step), else the real engine's warm-up profile
    (`warmup`, services/engine/warmup.py), its times x `margin`, else the real CPU engine's
    default, with a warning saying why the warm-up gave none."""
    if engine_config.sim is not None and not profile:
        from services.engine.sim_engine import step_timer  # noqa: PLC0415
        return prior_from_timer(step_timer(engine_config.sim), "sim engine", budget)
    if profile or warmup is None:
        return prior_for(kv_bytes_per_token, profile=profile, budget=budget)
    measured = prior_from_steps(warmup.steps, measured_source(warmup, margin))
    if measured is not None and not warmup.error:
        return measured.scaled(margin)
    fallback = default_prior(kv_bytes_per_token)
    why = warmup.error or f"{len(warmup.steps)} step shapes measured, too few to fit"
    log.warning("the warm-up profile gave no prior (%s): the default, %s", why, fallback.source)
    return replace(fallback, source=f"{fallback.source}; warm-up failed: {why}")


def measured_source(warmup, margin: float = 1.0) -> str:
    """The prior's source for a warm-up profile: what it measured, in how long, and the margin
    its times are taken with."""
    return (f"measured-at-start: {len(warmup.steps)} step shapes in {warmup.elapsed_s:.2f} s, "
            f"times x{margin:g}")


def _transport(config: WorkerConfig, engine: EngineClient):
    """The KV transport of config.kv_backend (NIXL loads only if used); a simulated core's
    writes take the target's time (paced_transport)."""
    from services.kv_transfer import make_transport  # noqa: PLC0415
    transport = make_transport(config.kv_backend, config.worker_id, port=config.kv_port,
                               host=config.host)
    if engine.config.sim is not None:
        transport = paced_transport(transport, engine.config)
    return transport


def paced_transport(transport, config: EngineConfig):
    """The KV transport of a simulated core's worker: each write takes the modelled time of the
    target's real KV bytes at --sim-network-gbps (services/kv_transfer/paced.py)."""
    from services.engine.engine import resolve_model_dir  # noqa: PLC0415
    from services.engine.model.config import ModelConfig  # noqa: PLC0415
    from services.engine.sim_engine import transfer_timer  # noqa: PLC0415
    from services.kv_transfer.paced import PacedTransport  # noqa: PLC0415
    model_config = ModelConfig.from_dir(resolve_model_dir(config.model))
    return PacedTransport(transport, transfer_timer(config.sim, model_config))
