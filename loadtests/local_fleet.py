"""A kvfleet fleet on this host, configured for a workload: used by the end-to-end load test and by
`kvfleet bench evaluation` (docs/evaluation.md).

The fleet is `kvfleet up` itself, run as a child process (the same processes, same flags), with
an engine config naming the workload's tenants (their weights and classes) and one API key per
tenant, so the gateway knows each request's tenant and class from its key, as in production.
Nothing here imports kvfleet's services: the load tester talks to the fleet over HTTP only.
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

UP_READY_S = 300.0          # `kvfleet up` to READY (loads the model in every worker)
UP_STOP_S = 30.0            # SIGTERM to exit; then its process group is killed
REDIS_READY_S = 10.0


@dataclass(frozen=True)
class FleetSetup:
    mode: str = "colocated"                      # colocated | disagg
    model: str = "tiny"
    scheduler: dict = field(default_factory=dict)   # SchedulerConfig overrides (token_budget, ...)
    kv_backend: str = "tcp"
    kv_cache_mib: int = 256
    key_overrides: dict = field(default_factory=dict)   # tenant -> key file fields (quotas) to change


@dataclass(frozen=True)
class LocalFleet:
    endpoint: str                                # http://127.0.0.1:PORT
    tenant_keys: dict[str, str]
    output: list[str]                            # `kvfleet up`'s lines so far (its process list, logs dir)


def tenant_key(tenant: str) -> str:
    return f"sk-load-{tenant}"


def write_fleet_config(tenants: list[TenantSpec], setup: FleetSetup, folder: Path) -> tuple[str, str]:
    """engine.yaml (tenants with their weights and classes) and keys.yaml (a key per tenant, quotas
    high enough never to be what limits a load test, unless `setup.key_overrides` says otherwise)."""
    scheduler = {"default_tenant": tenants[0].name,
                 "tenants": [{"name": t.name, "weight": t.weight, "classes": [t.traffic_class]}
                             for t in tenants],
                 **setup.scheduler}
    keys = [{"key": tenant_key(t.name), "tenant": t.name, "traffic_class": t.traffic_class,
             "max_concurrent_streams": 4096, "requests_per_minute": 1_000_000,
             "tokens_per_minute": 1_000_000_000, **setup.key_overrides.get(t.name, {})} for t in tenants]
    (folder / "engine.yaml").write_text(yaml.safe_dump({"scheduler": scheduler}))
    (folder / "keys.yaml").write_text(yaml.safe_dump(keys))
    return str(folder / "engine.yaml"), str(folder / "keys.yaml")


def up_command(setup: FleetSetup, engine_yaml: str, keys_yaml: str, redis_url: str | None) -> list[str]:
    """`kvfleet up` for this setup, on ports the OS picks (the gateway's is read from READY)."""
    redis = ["--redis-url", redis_url] if redis_url else []
    return [sys.executable, "-m", "services.cli.cli", "up", "--model", setup.model, "--mode", setup.mode,
            "--prefill", "1", "--decode", "1", "--host", "127.0.0.1", "--http-port", "0",
            "--grpc-port", "0", "--api-keys", keys_yaml, "--kv-backend", setup.kv_backend,
            "--kv-cache-mib", str(setup.kv_cache_mib), "--config", engine_yaml, *redis]


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
        gateway, output = stack.enter_context(kvfleet_up(up_command(setup, engine_yaml, keys_yaml,
                                                                    redis_url)))
        yield LocalFleet(f"http://{gateway}", {t.name: tenant_key(t.name) for t in tenants}, output)


@contextlib.contextmanager
def kvfleet_up(command: list[str], ready_s: float = UP_READY_S) -> Iterator[tuple[str, list[str]]]:
    """Run `command` (a `kvfleet up`) until it prints `READY up HOST:PORT`; yield that address and
    its output lines (kept up to date: its pipe is drained while it runs). On exit: SIGTERM, and
    its whole process group killed if it has not ended within UP_STOP_S."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    ready: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc, lines, ready), daemon=True).start()
    try:
        yield _wait_ready(ready, lines, ready_s), lines
    finally:
        _stop(proc)


def _pump(proc: subprocess.Popen, lines: list[str], ready: queue.Queue) -> None:
    for line in proc.stdout:
        lines.append(line.rstrip())
        if line.startswith("READY up "):
            ready.put(line.split()[-1])
    ready.put(None)                                   # the process ended


def _wait_ready(ready: queue.Queue, lines: list[str], timeout_s: float) -> str:
    try:
        address = ready.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(f"kvfleet up: not READY after {timeout_s:.0f} s:\n"
                           + "\n".join(lines[-30:])) from None
    if address is None:
        raise RuntimeError("kvfleet up exited before READY:\n" + "\n".join(lines[-30:]))
    return address


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=UP_STOP_S)
            return
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)          # anything of its group still alive
    proc.wait()


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
