"""`kvfleet up` as a child process: the one way tests, benches and `kvfleet bench evaluation`
(docs/evaluation.md) start a whole fleet on this host.

`kvfleet_up(model, ...)` runs `kvfleet up` itself (the same processes, same flags as a user's),
reads its banner into an `UpFleet` (gateway, routers, workers with their pids and metrics URLs,
Redis), waits for READY within a deadline, and on exit stops it: SIGTERM, SIGKILL to whatever of
its tree is left past a grace, and waits until nothing of it runs. `engine="sim"` (with
`sim_args`) starts the workers on the simulated engine core instead of the model.

`local_fleet(tenants, setup)` is that fleet configured for a load test's workload: an engine
config naming the workload's tenants (their weights and classes) and one API key per tenant, so
the gateway knows each request's tenant and class from its key, as in production. The load
tester itself talks to the fleet over HTTP only.
"""
from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from loadtests.workload import TenantSpec
from services.engine.config import KV_CACHE_MIB
from services.protocol import env

UP_READY_S = 300.0          # `kvfleet up` to READY (loads the model in every worker)
UP_STOP_S = 30.0            # SIGTERM to exit; then whatever is left of its tree is killed
GONE_S = 10.0               # after SIGKILL: every process of the tree reaped or gone
REDIS_READY_S = 10.0
ENV_TOKEN = env.FLEET_TOKEN.name


# ------------------------------------------------------------------------- `kvfleet up`, typed

@dataclass(frozen=True)
class Service:
    """One router or worker of the fleet, as its banner named it."""
    name: str                 # prefill-0, decode-0, mixed-0, router-0
    role: str                 # prefill | decode | mixed | router
    address: str              # gRPC host:port
    metrics_url: str          # http://host:port/metrics ("" if it announced none)
    pid: int | None           # its process at READY (`UpFleet.pid` follows a restart)


@dataclass
class UpFleet:
    """A running `kvfleet up`: its process, its banner's endpoints, its output so far (kept up to
    date: its pipe is drained while it runs)."""
    proc: subprocess.Popen
    http: str                                    # the gateway's REST host:port
    grpc: str                                    # the gateway's gRPC host:port
    redis_url: str
    routers: dict[str, Service]
    workers: dict[str, Service]
    lines: list[str]
    listeners: list[tuple[str, str, str]] = field(default_factory=list)   # (service, kind, host:port)
    log_dir: str = ""
    token: str | None = None                     # the fleet token, when the caller set one
    ready_at: float = 0.0                        # time.monotonic() when its READY line came
    model: str = ""                              # the first served model name
    redis_password: str = ""                     # the embedded Redis's (redis_url carries it)

    @property
    def url(self) -> str:
        return f"http://{self.http}"

    def children(self) -> dict[int, str]:
        """pid -> command line of each live service `kvfleet up` started (its children; under
        --ray, its Ray actors' children), read from /proc."""
        return _children(self.proc.pid)

    def pid(self, name: str) -> int | None:
        """The live process serving `name` (a worker, a router, or "gateway"), found by its
        command line, so it follows the supervisor's restarts."""
        return _pid_of(name, self.children())

    def signal(self, name: str, sig: int) -> int:
        pid = self.pid(name)
        if pid is None:
            raise LookupError(f"{name} is not running")
        os.kill(pid, sig)
        return pid

    def tree(self) -> list[int]:
        """`kvfleet up` and every live process under it."""
        from services.cli.launcher import descendants  # noqa: PLC0415
        return [self.proc.pid, *descendants(self.proc.pid)]


def _children(pid: int) -> dict[int, str]:
    """The services under `pid`: every live process of its tree that runs the launcher's command
    (`python -m services.cli.lifeline ...`, services/cli/lifeline.py)."""
    from services.cli.launcher import descendants  # noqa: PLC0415
    found = {}
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue                       # gone meanwhile
        if " services.cli.lifeline " in args:
            found[child] = args
    return found


def _pid_of(name: str, children: dict[int, str]) -> int | None:
    mark = ("services.gateway" if name == "gateway" else
            f"--router-id {name} " if name.startswith("router-") else f"--worker-id {name} ")
    return next((pid for pid, args in children.items() if mark in args + " "), None)


def up_command(model: str, *args: str, mode: str | None = None, routers: int | None = None,
               redis_url: str | None = None, config: str | None = None,
               api_keys: str | None = None, kv_cache_mib: int | None = None,
               http_port: int | None = 0, grpc_port: int | None = 0, engine: str = "real",
               sim_args: tuple[str, ...] = ()) -> list[str]:
    """`kvfleet up`'s command line. None leaves a flag to `kvfleet up`'s default; the gateway's
    ports default to 0 (the OS picks; the banner says which). `engine` other than "real" adds
    `--engine ENGINE` and `sim_args` (e.g. ("--sim-kv-tokens", "4096"))."""
    if engine != "real":
        args = ("--engine", engine, *sim_args, *args)
    elif sim_args:
        raise ValueError(f"sim_args {sim_args} need engine='sim'")
    flags = {"--mode": mode, "--routers": routers, "--redis-url": redis_url, "--config": config,
             "--api-keys": api_keys, "--kv-cache-mib": kv_cache_mib, "--http-port": http_port,
             "--grpc-port": grpc_port}
    named = [x for flag, value in flags.items() if value is not None for x in (flag, str(value))]
    return [sys.executable, "-m", "services.cli.cli", "up", "--model", str(model), *named, *args]


@contextlib.contextmanager
def kvfleet_up(model: str, *args: str, env: dict[str, str] | None = None,
               token: str | None = None, ready_s: float = UP_READY_S, stop_s: float = UP_STOP_S,
               **flags) -> Iterator[UpFleet]:
    """Start `kvfleet up --model MODEL ARGS...` (`flags`: up_command's keywords: mode, routers,
    redis_url, config, api_keys, kv_cache_mib, http_port, grpc_port, engine, sim_args) and yield
    its UpFleet once READY (RuntimeError with its output if it ends or is not READY within
    `ready_s`). `env` is added to this process's environment for the whole fleet; `token` is the
    fleet token its processes share. On exit, whatever happened: `stop(fleet)`."""
    from services.state import redis_auth  # noqa: PLC0415
    # the embedded Redis's password: the caller's (env; "" lets kvfleet up make its own, which
    # only its log folder then knows), else a new one (kvfleet up takes it)
    password = (env or {}).get(redis_auth.ENV_PASSWORD, redis_auth.generate())
    extra = {**(env or {}), redis_auth.ENV_PASSWORD: password,
             **({ENV_TOKEN: token} if token else {})}
    proc = subprocess.Popen(up_command(model, *args, **flags), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **extra})
    lines: list[str] = []
    ready: queue.Queue[float | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc, lines, ready), daemon=True).start()
    try:
        ready_at = _wait_ready(ready, lines, ready_s)
        fleet = _fleet(proc, lines, token, ready_at)
        # a given --redis-url keeps its own credentials; the embedded server's takes `password`
        if flags.get("redis_url"):
            fleet.redis_url = flags["redis_url"]
        elif password:
            fleet.redis_url = fleet.redis_url.replace("redis://", f"redis://:{password}@", 1)
        fleet.redis_password = password
        yield fleet
    finally:
        stop(proc, stop_s)


def _pump(proc: subprocess.Popen, lines: list[str], ready: queue.Queue) -> None:
    from services.cli.up import READY_PREFIX  # noqa: PLC0415
    for line in proc.stdout:
        lines.append(line.rstrip())
        if line.startswith(READY_PREFIX):
            ready.put(time.monotonic())
    ready.put(None)                                   # the process ended


def _wait_ready(ready: queue.Queue, lines: list[str], timeout_s: float) -> float:
    """When READY came (time.monotonic()); RuntimeError if the process ended or it did not come."""
    try:
        came = ready.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(f"kvfleet up: not READY after {timeout_s:.0f} s:\n"
                           + "\n".join(lines[-30:])) from None
    if came is None:
        raise RuntimeError("kvfleet up exited before READY:\n" + "\n".join(lines[-30:]))
    return came


def _fleet(proc: subprocess.Popen, lines: list[str], token: str | None, ready_at: float) -> UpFleet:
    """The banner (its lines up to READY, which `kvfleet up` prints after all of them) as an
    UpFleet; each router's and worker's pid read from /proc now."""
    from services.cli.up import READY_PREFIX, Banner  # noqa: PLC0415
    end = next(i for i, line in enumerate(lines) if line.startswith(READY_PREFIX))
    banner = Banner(lines[:end + 1])
    address = {(service, kind): at for service, kind, at in banner.listeners}
    children = _children(proc.pid)

    def service(name: str) -> Service:
        metrics = address.get((name, "metrics"))
        return Service(name, name.rsplit("-", 1)[0], address[(name, "grpc")],
                       f"http://{metrics}/metrics" if metrics else "", _pid_of(name, children))
    names = sorted({s for s, _ in address if s not in ("gateway", "redis")})
    http = lines[end].split()[-1]
    return UpFleet(proc=proc, http=http, grpc=address[("gateway", "grpc")],
                   redis_url=banner.redis_url or "",
                   routers={n: service(n) for n in names if n.startswith("router-")},
                   workers={n: service(n) for n in names if not n.startswith("router-")},
                   lines=lines, listeners=banner.listeners,
                   log_dir=lines[0].partition("logs in ")[2], token=token, ready_at=ready_at,
                   model=_served_model(http))


def _served_model(http: str) -> str:
    """The first model the gateway serves (its /v1/models), "" if it does not answer."""
    import httpx  # noqa: PLC0415
    with contextlib.suppress(httpx.HTTPError, KeyError, IndexError, ValueError):
        return httpx.get(f"http://{http}/v1/models", timeout=10).json()["data"][0]["id"]
    return ""


def stop(proc: subprocess.Popen, grace_s: float = UP_STOP_S) -> None:
    """SIGTERM `kvfleet up`; past `grace_s`, SIGKILL its group and every process of its tree (its
    children run in sessions of their own); return once none of them runs."""
    from services.cli.launcher import descendants, running  # noqa: PLC0415
    tree = descendants(proc.pid) if proc.poll() is None else []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    tree += [p for p in descendants(proc.pid) if p not in tree] if proc.poll() is None else []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)          # anything of its group still alive
    for pid in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + GONE_S
    while any(map(running, tree)) and time.monotonic() < deadline:
        time.sleep(0.02)                             # SIGKILL is delivered, not yet done


# ------------------------------------------------------------- a fleet for a load test

@dataclass(frozen=True)
class FleetSetup:
    mode: str = "colocated"                      # colocated | disagg
    model: str = "tiny"
    scheduler: dict = field(default_factory=dict)   # SchedulerConfig overrides (token_budget, ...)
    kv_backend: str = "tcp"
    kv_cache_mib: int = KV_CACHE_MIB
    key_overrides: dict = field(default_factory=dict)   # tenant -> key file fields (quotas) to change
    engine: str = "real"                         # real | sim (the simulated engine core)
    sim_args: tuple[str, ...] = ()               # --sim-kv-tokens N, --sim-model ... (engine sim)
    env: dict = field(default_factory=dict)      # added to the fleet's environment (a step trace)
    prefill: int = 1                             # workers: prefill (disagg) and decode (disagg)
    decode: int = 1                              # or mixed (colocated)
    max_in_progress: int | None = None           # the gateway's front door (None: its default)


@dataclass(frozen=True)
class LocalFleet:
    endpoint: str                                # http://127.0.0.1:PORT
    tenant_keys: dict[str, str]
    output: list[str]                            # `kvfleet up`'s lines so far (its process list, logs dir)
    up: UpFleet | None = None                    # the running `kvfleet up` itself


def tenant_key(tenant: str) -> str:
    return f"sk-load-{tenant}"


def write_fleet_config(tenants: list[TenantSpec], setup: FleetSetup, folder: Path) -> tuple[str, str]:
    """engine.yaml (tenants with their weights and classes) and keys.yaml (a key per tenant, quotas
    high enough never to be what limits a load test, unless `setup.key_overrides` says otherwise)."""
    scheduler = {"default_tenant": tenants[0].name,
                 "tenants": [{"name": t.name, "weight": t.weight, "classes": [t.traffic_class],
                              **({"min_kv_blocks": t.min_kv_blocks} if t.min_kv_blocks else {}),
                              **({"critical": True} if t.critical else {})} for t in tenants],
                 **setup.scheduler}
    keys = [{"key": tenant_key(t.name), "tenant": t.name, "traffic_class": t.traffic_class,
             "max_concurrent_streams": 4096, "requests_per_minute": 1_000_000,
             "tokens_per_minute": 1_000_000_000, **setup.key_overrides.get(t.name, {})} for t in tenants]
    (folder / "engine.yaml").write_text(yaml.safe_dump({"scheduler": scheduler}))
    (folder / "keys.yaml").write_text(yaml.safe_dump(keys))
    return str(folder / "engine.yaml"), str(folder / "keys.yaml")


def up_options(setup: FleetSetup, engine_yaml: str, keys_yaml: str, redis_url: str | None
               ) -> tuple[list[str], dict]:
    """`kvfleet up`'s arguments for this setup: (extra flags, kvfleet_up's keywords)."""
    return (["--prefill", str(setup.prefill), "--decode", str(setup.decode), "--host", "127.0.0.1",
             "--kv-backend", setup.kv_backend,
             *([] if setup.max_in_progress is None
               else ["--max-in-progress", str(setup.max_in_progress)])],
            dict(mode=setup.mode, redis_url=redis_url, config=engine_yaml, api_keys=keys_yaml,
                 kv_cache_mib=setup.kv_cache_mib, engine=setup.engine, sim_args=setup.sim_args,
                 env=dict(setup.env) or None))


@contextlib.contextmanager
def local_fleet(tenants: list[TenantSpec], setup: FleetSetup,
                redis_url: str | None = None) -> Iterator[LocalFleet]:
    """Start the fleet for these tenants (a workload's `spec.tenants`); on exit stop it, and with
    it every process it started. Without `redis_url`: a redis-server child when one is installed
    (`kvfleet up`'s embedded one is slower under load), else the embedded one."""
    folder = Path(tempfile.mkdtemp(prefix="kvfleet-load-"))
    engine_yaml, keys_yaml = write_fleet_config(tenants, setup, folder)
    with contextlib.ExitStack() as stack:
        if redis_url is None:
            redis_url = _start_redis(stack)
        args, options = up_options(setup, engine_yaml, keys_yaml, redis_url)
        up = stack.enter_context(kvfleet_up(setup.model, *args, **options))
        yield LocalFleet(up.url, {t.name: tenant_key(t.name) for t in tenants}, up.lines, up)


def _start_redis(stack: contextlib.ExitStack) -> str | None:
    """A redis-server child on a free port (no persistence), or None when none is installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(lambda: (proc.terminate(), proc.wait()))
    deadline = time.monotonic() + REDIS_READY_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return f"redis://127.0.0.1:{port}/0"
        if proc.poll() is not None:
            break
        time.sleep(0.05)                             # poll interval while redis-server binds
    raise RuntimeError(f"redis-server on port {port} did not answer PING within {REDIS_READY_S} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """`python -m loadtests.local_fleet WORKLOAD DIR`: write DIR/engine.yaml and DIR/keys.yaml for
    `kvfleet up --config ... --api-keys ...` (what `local_fleet` starts, for a fleet run by hand)."""
    from loadtests.workload import load_workload
    workload, folder = (argv if argv is not None else sys.argv[1:])[:2]
    Path(folder).mkdir(parents=True, exist_ok=True)
    print(*write_fleet_config(list(load_workload(workload).tenants), FleetSetup(), Path(folder)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
