"""A kvfleet fleet on this host, configured for a workload: used by the end-to-end load test and by
`kvfleet bench evaluation` (docs/evaluation.md).

The fleet is `kvfleet up`'s (services/cli/up.py: the same processes, same flags) with an engine
config naming the workload's tenants (their weights and classes) and one API key per tenant, so
the gateway knows each request's tenant and class from its key, as in production.
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from services.cli.launcher import Launcher
from services.state.redis_server import EmbeddedRedis, RedisNotInstalledError, RedisServerProcess
from services.cli.up import start_fleet
from loadtests.workload import TenantSpec


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
    launcher: Launcher


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


@contextlib.contextmanager
def local_fleet(tenants: list[TenantSpec], setup: FleetSetup,
                redis_url: str | None = None) -> Iterator[LocalFleet]:
    """Start the fleet for these tenants (a workload's `spec.tenants`); on exit stop every process
    it started. Without `redis_url`: a redis-server child when one is installed (the embedded one
    is slower under load), else the embedded one."""
    folder = Path(tempfile.mkdtemp(prefix="kvfleet-load-"))
    engine_yaml, keys_yaml = write_fleet_config(tenants, setup, folder)
    up = argparse.Namespace(model=setup.model, mode=setup.mode, prefill=1, decode=1, host="127.0.0.1",
                            http_port=0, grpc_port=0, redis_url=None, api_keys=keys_yaml,
                            kv_backend=setup.kv_backend, kv_cache_mib=setup.kv_cache_mib,
                            insecure=False, config=engine_yaml)
    with contextlib.ExitStack() as stack:
        if redis_url is None:
            redis_url = _start_redis(stack)
        launcher = Launcher()
        stack.callback(launcher.stop_all)
        endpoints = start_fleet(up, launcher, redis_url)
        yield LocalFleet(f"http://{endpoints['gateway']}", {t.name: tenant_key(t.name) for t in tenants},
                         launcher)


def _start_redis(stack: contextlib.ExitStack) -> str:
    try:
        server = RedisServerProcess()
        server.start()
        stack.callback(server.stop)
        return server.url
    except RedisNotInstalledError:
        embedded = EmbeddedRedis().start()
        stack.callback(embedded.stop)
        return embedded.url


def main(argv: list[str] | None = None) -> int:
    """`python -m loadtests.local_fleet WORKLOAD DIR`: write DIR/engine.yaml and DIR/keys.yaml for
    `kvfleet up --config ... --api-keys ...` (what `local_fleet` starts, for a fleet run by hand)."""
    import sys

    from loadtests.workload import load_workload
    workload, folder = (argv if argv is not None else sys.argv[1:])[:2]
    Path(folder).mkdir(parents=True, exist_ok=True)
    print(*write_fleet_config(list(load_workload(workload).tenants), FleetSetup(), Path(folder)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
