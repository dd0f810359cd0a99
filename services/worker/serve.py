"""Serve one worker process from `kvfleet serve ROLE`'s arguments: the engine core process
(services/worker/engine_core.py) and this server process, which serves gRPC on 127.0.0.1, moves KV
and heartbeats its stats into Redis, assembled by build.py (build_worker). The role comes from the
entry (`kvfleet serve ROLE`, `python -m services.prefill|decode|mixed`: services/cli/serve_cmd.py),
which knows the roles by name; this module knows none.

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
from dataclasses import replace


from services.engine.config import (EngineConfig, add_engine_args, add_sim_args, role_scheduler,
                                    sim_config_from_args)
from services.engine.config_file import load_engine_config
from services.engine.model_zoo import resolve as resolve_model
from services.engine.quality_version import of_engine_config
from services.kv_transfer import PROCESS_BACKENDS
from services.protocol import bind, fleet_token, timeouts
from services.protocol.aio import setup_logging
from services.protocol.shutdown import wait_for_stop_signal
from services.telemetry import exposition, tracing
from services.worker.build import Worker, build_worker
from services.worker.config import POOLS, WorkerConfig
from services.worker.drain import drain
from services.worker.role import Role

log = logging.getLogger(__name__)

ENGINE_FAILED_EXIT = 70     # EX_SOFTWARE: the engine core died; the supervisor restarts the worker


def add_worker_args(p: argparse.ArgumentParser, role: str | None = None) -> None:
    if role is None:
        p.add_argument("role", choices=["prefill", "decode", "mixed"])
    p.add_argument("--model", default="tiny")
    p.add_argument("--config", help="engine config YAML (classes, tenants, budgets)")
    p.add_argument("--host", default="127.0.0.1")
    bind.add_args(p)
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--kv-port", type=int, default=0,
                   help="the tcp KV backend's receiver, on --host (0 picks a free port)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--redis-url", default=None, help="heartbeat capacity here (optional)")
    p.add_argument("--kv-backend", default="tcp", choices=PROCESS_BACKENDS)
    p.add_argument("--pool", default="primary", choices=list(POOLS),
                   help="the pool this worker serves in (the router's fallback pool: DESIGN 6, S3)")
    p.add_argument("--kv-cache-mib", type=int, default=None)
    p.add_argument("--step-profile", default=None, metavar="FILE",
                   help="a measured step profile (kvfleet sim calibrate): the prefill cost prior "
                        "this worker publishes until it has measured its own")
    p.add_argument("--warmup-timeout", type=float, default=WorkerConfig.warmup_timeout_s,
                   metavar="S", help="a real engine measures its step times at start, before it "
                   "serves, for at most S seconds (its cost prior; past S, or if it fails, the "
                   "default prior); 0: no warm-up")
    p.add_argument("--warmup-margin", type=float, default=WorkerConfig.warmup_margin,
                   metavar="X", help="the warm-up's measured step times x X make the prior "
                   "(default: 2 on the CPU, where the fleet's processes share the cores and a "
                   "burst's steps ran ~2x slower than one step alone; 1 on an accelerator)")
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
    if getattr(args, "cuda_graphs", None):
        cfg = replace(cfg, cuda_graphs=args.cuda_graphs)
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


async def serve(args: argparse.Namespace, role: Role) -> int:
    """Serve `role` (the entry's choice, services/cli/serve_cmd.py) as `args` configure it, until
    SIGTERM / SIGINT, a drain's end, or the engine core's death; the exit status."""
    setup_logging(args.role)
    bind.check(args.host, args.allow_external_bind, "a worker")
    auth = fleet_token.configure(args, f"{args.role} worker")   # before anything loads
    config = worker_config_for(args)
    if args.threads and config.engine.sim is None:   # a simulated worker runs no torch
        import torch  # noqa: PLC0415
        torch.set_num_threads(args.threads)
    log.info("%s", config_line(config.worker_id, args, config.engine))
    tracing.setup(args.role, config.worker_id)
    worker = build_worker(config, role, auth)
    await worker.start()
    try:
        return await _serve(worker)
    finally:
        await worker.stop(exiting=True)


def worker_config_for(args: argparse.Namespace) -> WorkerConfig:
    """The worker's config from `kvfleet serve ROLE`'s arguments."""
    engine_config = engine_config_for(args)
    return WorkerConfig(
        args.worker_id or f"{args.role}-{os.getpid()}", args.role, args.kv_backend,
        timeouts.from_args(args), tensor_parallel_size=engine_config.tensor_parallel_size,
        pool=args.pool, quality_version=worker_quality_version(engine_config),
        engine=engine_config, host=args.host, allow_external_bind=args.allow_external_bind,
        port=args.port, kv_port=args.kv_port,
        redis_url=args.redis_url, metrics_port=args.metrics_port,
        step_profile=args.step_profile, torch_threads=args.threads,
        warmup_timeout_s=args.warmup_timeout, warmup_margin=args.warmup_margin)


async def _serve(worker: Worker) -> int:
    """The started worker until it is told to stop: its listener lines and READY on stdout,
    then the signals (SIGUSR1 drains first); the exit status."""
    worker_id = worker.config.worker_id
    stop = asyncio.Event()          # SIGTERM / SIGINT, a drain's end, or the engine core died
    stopping = asyncio.create_task(wait_for_stop_signal(stop))
    dead = asyncio.create_task(_set_when(worker.engine_failed, stop))
    draining = on_drain_signal(worker, stop)
    await asyncio.sleep(0)             # its SIGTERM handler is in place before anyone sees READY
    if worker.telemetry.metrics_url:
        print(f"METRICS {worker_id} {worker.telemetry.metrics_url}", flush=True)
    if getattr(worker.transport, "address", None):            # the tcp backend's KV receiver
        print(f"KV {worker_id} {worker.transport.address}", flush=True)
    for ucx in getattr(worker.transport, "listeners", ()):    # nixl: UCX's tcp listener
        print(f"UCX {worker_id} {ucx}", flush=True)
    print(f"READY {worker_id} {worker.address}", flush=True)
    await stopping
    for task in (dead, *draining):
        task.cancel()
    if worker.engine.failure is not None:
        print(f"worker {worker_id}: {worker.engine.failure}; exiting with status "
              f"{ENGINE_FAILED_EXIT}", file=sys.stderr, flush=True)
        return ENGINE_FAILED_EXIT
    return 0


async def _set_when(event: asyncio.Event, then: asyncio.Event) -> None:
    await event.wait()
    then.set()


def on_drain_signal(worker: Worker, stop: asyncio.Event) -> list:
    """SIGUSR1 drains this worker (services/worker/drain.py: it leaves the fleet, the health
    probe saying NOT_SERVING first, and finishes what it holds), then sets `stop`; the list
    holds the drain's task once it runs."""
    tasks: list[asyncio.Task] = []
    worker_id = worker.config.worker_id

    async def run() -> None:
        log.info("worker %s: draining (SIGUSR1)", worker_id)
        try:
            done = await drain(worker.servicer.stats, worker.leave)
            log.info("worker %s: %s", worker_id,
                     "drained" if done else "drain limit reached; stopping with work held")
        except Exception as e:  # noqa: BLE001 - a drain that fails still ends in the stop
            log.warning("worker %s: drain failed (%s); stopping", worker_id, e)
        stop.set()

    def start() -> None:
        if not tasks:
            tasks.append(asyncio.get_running_loop().create_task(run()))

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, start)
    return tasks
