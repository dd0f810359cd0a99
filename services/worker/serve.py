"""Start one worker: the engine core process (services/worker/engine_core.py) and this server
process, which serves gRPC on 127.0.0.1, moves KV and heartbeats its stats into Redis.
`python -m services.prefill|services.decode` and `kvfleet serve ROLE` land here.

Telemetry (services/worker/telemetry.py): Prometheus `/metrics` on 127.0.0.1:--metrics-port
(WorkerStats.metrics_url names it; -1: none), its gauges refreshed from the stats each heartbeat
takes (without Redis, on the heartbeat's period all the same); OTLP traces when the OTEL_*
environment names an endpoint (services/telemetry/tracing.py).

Prints one line `READY <worker_id> <host:port>` on stdout once serving (launchers and tests wait
for it), after `METRICS <worker_id> <url>` and `KV <worker_id> <host:port>` (the tcp backend's
receiver) or `UCX <worker_id> <host:port>` (nixl: UCX's tcp listener) for the listeners it has.
SIGTERM / SIGINT: stop accepting, drop the Redis record,
stop the engine core, exit 0. SIGUSR1: drain (services/worker/drain.py: leave Redis, finish what it
holds), then stop as on SIGTERM. The engine core dies: its requests fail, the worker reports
NOT_SERVING and exits ENGINE_FAILED_EXIT (the supervisor restarts it).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import replace
from typing import Callable, NoReturn

import grpc
from redis.exceptions import RedisError

from services.engine.config import (EngineConfig, add_engine_args, add_sim_args, role_scheduler,
                                    sim_config_from_args)
from services.engine.config_file import load_engine_config
from services.engine.model_zoo import resolve as resolve_model
from services.engine.quality_version import of_engine_config
from services.kv_transfer import PROCESS_BACKENDS
from services.protocol import fleet_token, timeouts
from services.protocol.aio import LOOPBACK, run, setup_logging
from services.protocol.standard_health import StandardHealth, add_standard_health
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.shutdown import exit_now, wait_for_stop_signal
from services.state.fleet_state import FleetState
from services.state.wait_queue import WaitQueue
from services.state.outage import UNREACHABLE, Backoff, Outage
from services.telemetry import exposition, tracing
from services.worker.engine_client import EngineClient, EngineFailed
from services.worker.config import POOLS, WorkerConfig
from services.worker.drain import drain
from services.worker.kv_events import KVEventPublisher, PublisherConfig
from services.worker.rates import WorkerRates, prior_for, prior_from_timer
from services.worker.servicer import WorkerServicer
from services.worker.telemetry import WorkerTelemetry

log = logging.getLogger(__name__)

ENGINE_FAILED_EXIT = 70     # EX_SOFTWARE: the engine core died; the supervisor restarts the worker


def _prior(engine_config: EngineConfig, profile: str | None, kv_bytes_per_token: int,
           budget: int):
    """What this worker publishes as its costs before it has measured any: a simulated engine's
    own step timer (its target's cost model, profile or fixed step), else --step-profile, else
    the real CPU engine's default (services/worker/rates.py)."""
    if engine_config.sim is not None and not profile:
        from services.engine.sim_engine import step_timer  # noqa: PLC0415
        return prior_from_timer(step_timer(engine_config.sim), "sim engine", budget)
    return prior_for(kv_bytes_per_token, profile=profile, budget=budget)


def add_worker_args(p: argparse.ArgumentParser, role: str | None = None) -> None:
    if role is None:
        p.add_argument("role", choices=["prefill", "decode", "mixed"])
    p.add_argument("--model", default="tiny")
    p.add_argument("--config", help="engine config YAML (classes, tenants, budgets)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--kv-port", type=int, default=0,
                   help="the tcp KV backend's receiver on 127.0.0.1 (0 picks a free port)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--redis-url", default=None, help="heartbeat capacity here (optional)")
    p.add_argument("--kv-backend", default="tcp", choices=PROCESS_BACKENDS)
    p.add_argument("--pool", default="primary", choices=list(POOLS),
                   help="the pool this worker serves in (the router's fallback pool: DESIGN 6, S3)")
    p.add_argument("--kv-cache-mib", type=int, default=None)
    p.add_argument("--step-profile", default=None, metavar="FILE",
                   help="a measured step profile (kvfleet sim calibrate): the prefill cost prior "
                        "this worker publishes until it has measured its own")
    add_engine_args(p)
    add_sim_args(p)
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the model over N processes (the engine core is rank 0); prefill and "
                        "decode workers ship KV rank to rank, so both need the same N")
    p.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads (0: torch's default); several workers on one "
                        "host should split the cores between them")
    fleet_token.add_args(p)
    timeouts.add_args(p)
    exposition.add_args(p)
    if role is not None:
        p.set_defaults(role=role)


def worker_quality_version(cfg: EngineConfig) -> str:
    """The quality version this worker's outputs carry (its model resolved to a directory)."""
    return of_engine_config(replace(cfg, model=resolve_model(cfg.model)))

def config_line(worker_id: str, args: argparse.Namespace, cfg: EngineConfig) -> str:
    """The engine settings a worker runs, and where they came from: its --config file, and the
    role's defaults (engine/config.py role_scheduler) for what the file does not set."""
    s = cfg.scheduler
    source = (f"--config {args.config}, the {args.role} role's defaults for the rest"
              if args.config else f"the {args.role} role's defaults, no --config")
    engine = "sim" if cfg.sim is not None else "real"
    return (f"worker {worker_id}: role {args.role}, engine {engine}, kv_cache_mib "
            f"{cfg.kv_cache_mib}, token_budget {s.token_budget}, chunk_size {s.chunk_size} "
            f"({source})")


def engine_config_for(args: argparse.Namespace) -> EngineConfig:
    cfg = (load_engine_config(args.config, args.role) if args.config
           else EngineConfig(scheduler=role_scheduler(args.role)))
    cfg = replace(cfg, model=args.model, scheduler=replace(cfg.scheduler, role=args.role))
    if args.kv_cache_mib:
        cfg = replace(cfg, kv_cache_mib=args.kv_cache_mib)
    if getattr(args, "device", None):
        from services.engine.device import check_device  # noqa: PLC0415 - imports torch
        check_device(args.device, f"kvfleet serve {args.role}")
        cfg = replace(cfg, device=args.device)
    if getattr(args, "attention_backend", None):
        cfg = replace(cfg, attention_backend=args.attention_backend)
    if getattr(args, "kv_cache_dtype", None):
        cfg = replace(cfg, kv_cache_dtype=args.kv_cache_dtype)
    if getattr(args, "kv_cache_scales", None):
        cfg = replace(cfg, kv_cache_scales=args.kv_cache_scales)
    if getattr(args, "logprobs_mode", None):
        cfg = replace(cfg, logprobs_mode=args.logprobs_mode)
    if getattr(args, "tensor_parallel", 1) > 1:
        cfg = replace(cfg, tensor_parallel_size=args.tensor_parallel)
    sim = sim_config_from_args(args)
    if sim is not None:
        cfg = replace(cfg, sim=sim)
    return cfg


class _EngineStats:
    """This worker's stats as the engine core last answered them, with one call in flight at most.

    The core answers only between engine steps, so one long step (a big prefill on a loaded CPU)
    holds the answer back for as long as it runs. Invariants: `stats` is the last answer (None
    before the first); `answered_at` is when it came (the start before the first), so
    `silent_s()` is how long the core has kept the worker waiting."""

    def __init__(self, servicer: WorkerServicer, clock: Callable[[], float]) -> None:
        self._servicer, self._clock = servicer, clock
        self._call: asyncio.Future[pb.WorkerStats] | None = None
        self.stats: pb.WorkerStats | None = None
        self.answered_at = clock()

    async def take(self, wait_s: float) -> bool:
        """True when an answer came within `wait_s` (now in `stats`), False when the call is still
        in flight (it stays so: the next take waits on the same call). Raises what the call
        raised, EngineFailed included."""
        if self._call is None:
            self._call = asyncio.ensure_future(self._servicer.stats())
        done, _ = await asyncio.wait({self._call}, timeout=wait_s)
        if not done:
            return False
        call, self._call = self._call, None
        self.stats, self.answered_at = call.result(), self._clock()
        return True

    def silent_s(self) -> float:
        return self._clock() - self.answered_at

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()


async def heartbeat_forever(state: FleetState | None, servicer: WorkerServicer,
                            clock: Callable[[], float] = time.monotonic) -> None:
    """Every `heartbeat_s` until cancelled, take this worker's stats (the Stats RPC's message,
    which also refreshes its /metrics gauges) and publish them to Redis when there is one
    (`state`); each beat lives `heartbeat_ttl_s`.

    Liveness is not step length: one stats call to the engine core is in flight at a time, and a
    beat whose answer has not come (a step still running) publishes the last answer again: the
    worker is alive and its engine busy. Only once the core has been silent for `engine_stall_s`
    does the worker stop beating (one warning) and its Health answer NOT_SERVING: its record
    expires and it leaves the fleet until the core answers again (one info line; the next beat
    re-registers it). A core frozen for good is the supervisor's to restart (it probes Health). A dead engine core
    ends the loop: the worker is going down.

    A failed beat (Redis down, or anything else) never ends the loop: it is retried with capped,
    jittered backoff (one warning per outage, one info line on recovery), and the first beat that
    lands re-registers the worker, also into an empty new Redis."""
    config = servicer.config
    every_s, ttl_s = config.timeouts.heartbeat_s, config.timeouts.heartbeat_ttl_s
    redis = Outage(f"worker {config.worker_id} heartbeat", log,
                   Backoff(base_s=min(every_s, 0.5), cap_s=max(every_s, 2.0)))
    engine = _EngineStats(servicer, clock)
    broken = stalled = False       # the last beat failed on something other than Redis; ...
    try:                           # ... the core has been silent past engine_stall_s
        while True:
            began = clock()
            try:
                silent_s = engine.silent_s()
                fresh = await engine.take(every_s)
                stalled = _stall_changed(config, stalled, fresh, silent_s, engine.silent_s())
                servicer.engine_stalled = stalled      # Health answers NOT_SERVING meanwhile
                if state is not None and engine.stats is not None and not stalled:
                    engine.stats.updated_at_unix_s = time.time()      # this beat's time
                    await redis.call(state.heartbeat, engine.stats, ttl_s)
                delay, broken = every_s - (clock() - began), False
            except UNREACHABLE:
                delay = max(redis.retry_in(), 0.05)
            except EngineFailed:
                return
            except Exception:  # noqa: BLE001 - a bad beat must not end the worker's registration
                if not broken:         # one traceback per streak, not one per beat
                    log.exception("worker %s: heartbeat failed", config.worker_id)
                delay, broken = every_s - (clock() - began), True
            await asyncio.sleep(max(delay, 0.0))
    finally:
        engine.close()


def _stall_changed(config: WorkerConfig, stalled: bool, fresh: bool, silent_before_s: float,
                   silent_s: float) -> bool:
    """Whether the engine core counts as stalled after this beat's take, logging the change."""
    if fresh and stalled:
        log.info("worker %s: the engine core answered again after %.1f s; heartbeating again",
                 config.worker_id, silent_before_s)
        return False
    if not fresh and not stalled and silent_s > config.timeouts.engine_stall_s:
        log.warning("worker %s: the engine core has not answered for %.1f s (engine_stall_s "
                    "%g); heartbeat stopped: the worker leaves the fleet until it answers",
                    config.worker_id, silent_s, config.timeouts.engine_stall_s)
        return True
    return stalled


async def serve(args: argparse.Namespace) -> int:
    setup_logging(args.role)
    if args.host not in LOOPBACK:
        raise SystemExit(f"workers bind to loopback only in this build; got --host {args.host}")
    auth = fleet_token.configure(args, f"{args.role} worker")   # before anything loads
    worker_id = args.worker_id or f"{args.role}-{os.getpid()}"
    engine_config = engine_config_for(args)
    if args.threads and engine_config.sim is None:   # a simulated worker runs no torch
        import torch  # noqa: PLC0415
        torch.set_num_threads(args.threads)
    log.info("%s", config_line(worker_id, args, engine_config))
    config = WorkerConfig(worker_id, args.role, args.kv_backend, timeouts.from_args(args),
                          tensor_parallel_size=engine_config.tensor_parallel_size,
                          pool=args.pool, quality_version=worker_quality_version(engine_config))
    tracing.setup(args.role, worker_id)
    telemetry = WorkerTelemetry(args.role, worker_id)
    stop = asyncio.Event()       # SIGTERM / SIGINT, or the engine core died (engine.failure)
    engine = EngineClient(engine_config, on_failure=lambda _: stop.set(),
                          on_step=telemetry.on_step, torch_threads=args.threads)
    await engine.start()
    kv_bytes_per_token = engine.kv_cache.bytes_per_block // engine.block_size
    sched = engine_config.scheduler
    telemetry.rates = WorkerRates(
        _prior(engine_config, args.step_profile, kv_bytes_per_token, sched.token_budget),
        token_budget=sched.token_budget, chunk_size=sched.chunk_size,
        kv_bytes_per_token=kv_bytes_per_token)
    try:
        # its thread (a daemon) serves until the process exits: closing it would wait out its
        # poll interval inside the stop budget
        metrics = exposition.serve(telemetry.metrics.registry, args.metrics_port)
        if metrics is not None:
            telemetry.metrics_url = metrics.url
        return await _serve(args, auth, config, engine, stop, telemetry)
    finally:
        await engine.close()


async def _serve(args, auth, config: WorkerConfig, engine: EngineClient,
                 stop: asyncio.Event, telemetry: WorkerTelemetry) -> int:
    transport = None
    if args.role != "mixed":          # a co-located worker moves no KV
        from services.kv_transfer import make_transport  # noqa: PLC0415 - NIXL loads only if used
        transport = make_transport(args.kv_backend, config.worker_id, port=args.kv_port)
        if engine.config.sim is not None:   # the simulated core: writes take the target's time
            transport = paced_transport(transport, engine.config)
        telemetry.expect_kv(args.kv_backend)
        transport.register(engine.kv_cache)
    servicer = WorkerServicer(config, engine, transport, telemetry)
    server = grpc.aio.server(interceptors=fleet_token.server_interceptors(auth))
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    probe = add_standard_health(server, pb.DESCRIPTOR.services_by_name["Worker"].full_name,
                                servicer.Health)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    probe.start()
    address = f"{args.host}:{port}"
    state = FleetState(args.redis_url) if args.redis_url else None
    servicer.address = address
    beat = (asyncio.create_task(heartbeat_forever(state, servicer))
            if state is not None or telemetry.metrics_url else None)
    events = (asyncio.create_task(KVEventPublisher(
        PublisherConfig(config.worker_id, engine.block_size, config.timeouts.heartbeat_s),
        engine.kv_events).run(state)) if state is not None else None)
    notify = None
    if state is not None and args.role in ("decode", "mixed"):
        servicer.capacity.queue = WaitQueue(state.redis, state.ns)
        notify = asyncio.create_task(servicer.capacity.run())
    stopping = asyncio.create_task(wait_for_stop_signal(stop))
    draining = on_drain_signal(servicer, state, lambda: beat, stop, probe)
    await asyncio.sleep(0)             # its SIGTERM handler is in place before anyone sees READY
    if telemetry.metrics_url:
        print(f"METRICS {config.worker_id} {telemetry.metrics_url}", flush=True)
    if getattr(transport, "address", None):            # the tcp backend's KV receiver
        print(f"KV {config.worker_id} {transport.address}", flush=True)
    for ucx in getattr(transport, "listeners", ()):    # the nixl backend's: UCX's tcp listener
        print(f"UCX {config.worker_id} {ucx}", flush=True)
    print(f"READY {config.worker_id} {address}", flush=True)
    await stopping
    await probe.close()                # NOT_SERVING before anything stops
    failed = engine.failure is not None
    if failed:
        print(f"worker {config.worker_id}: {engine.failure}; exiting with status "
              f"{ENGINE_FAILED_EXIT}", file=sys.stderr, flush=True)
    for task in (beat, events, notify, *draining):
        if task:
            task.cancel()
    if state is not None:
        try:
            await state.remove_worker(config.worker_id)
        except RedisError as e:            # Redis down: the record expires with its TTL anyway
            log.warning("could not remove worker %s from Redis at shutdown: %s",
                        config.worker_id, e)
        await state.close()
    servicer.close()
    await server.stop(grace=config.timeouts.shutdown_grace_s)
    if transport is not None:
        transport.close()
    return ENGINE_FAILED_EXIT if failed else 0


def on_drain_signal(servicer: WorkerServicer, state: FleetState | None, beat, stop,
                    probe: StandardHealth | None = None) -> list:
    """SIGUSR1 drains this worker (services/worker/drain.py), then sets `stop`; the list holds
    the drain's task once it runs (`beat`: a callable giving the heartbeat task). The standard
    health probe says NOT_SERVING first, before the worker leaves Redis."""
    tasks: list[asyncio.Task] = []

    async def leave() -> None:
        if probe is not None:
            await probe.stopping()
        if beat() is not None:             # a beat in flight lands before the record goes
            beat().cancel()
            await asyncio.gather(beat(), return_exceptions=True)
        if state is not None:
            await state.remove_worker(servicer.config.worker_id)

    async def run() -> None:
        log.info("worker %s: draining (SIGUSR1)", servicer.config.worker_id)
        try:
            done = await drain(servicer.stats, leave)
            log.info("worker %s: %s", servicer.config.worker_id,
                     "drained" if done else "drain limit reached; stopping with work held")
        except Exception as e:  # noqa: BLE001 - a drain that fails still ends in the stop
            log.warning("worker %s: drain failed (%s); stopping", servicer.config.worker_id, e)
        stop.set()

    def start() -> None:
        if not tasks:
            tasks.append(asyncio.get_running_loop().create_task(run()))

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, start)
    return tasks


def paced_transport(transport, config: EngineConfig):
    """The KV transport of a simulated core's worker: each write takes the modelled time of the
    target's real KV bytes at --sim-network-gbps (services/kv_transfer/paced.py)."""
    from services.engine.engine import resolve_model_dir  # noqa: PLC0415
    from services.engine.model.config import ModelConfig  # noqa: PLC0415
    from services.engine.sim_engine import transfer_timer  # noqa: PLC0415
    from services.kv_transfer.paced import PacedTransport  # noqa: PLC0415
    model_config = ModelConfig.from_dir(resolve_model_dir(config.model))
    return PacedTransport(transport, transfer_timer(config.sim, model_config))


def main(role: str | None = None, argv: list[str] | None = None) -> NoReturn:
    parser = argparse.ArgumentParser(prog=f"kvfleet serve {role or ''}".strip())
    add_worker_args(parser, role)
    exit_now(run(serve(parser.parse_args(argv))))
