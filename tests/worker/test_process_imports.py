"""What a simulated fleet's processes import: a process that runs no model must not pay for torch
(seconds of CPU per process at start; a test fleet starts several).

Each entry module is imported in a fresh interpreter, as `kvfleet up` starts it, and that
interpreter's `sys.modules` is read. The gateway, the routers, `kvfleet up` itself, the simulated
worker (its KV transports over the core's pool, a numpy array in /dev/shm) and the simulated
engine core import no torch, and this keeps it so. The model's modules import torch only where
the real model or its KV tensors are used."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "triton", "safetensors", "matplotlib")

ENTRIES = {
    "kvfleet up": ("services.cli.cli", "services.cli.up", "services.cli.launcher",
                   "services.cli.supervisor", "services.cli.health_watch"),
    "gateway": ("services.gateway.server", "services.gateway.app"),
    "router": ("services.router.service",),
    "sim worker": ("services.cli.cli", "services.cli.serve_cmd", "services.worker.serve",
                   "services.worker.build", "services.worker.engine_client",
                   "services.kv_transfer.tcp", "services.kv_transfer.local",
                   "services.kv_transfer.paced"),
    "sim engine core": ("services.worker.engine_core", "services.engine.engine",
                        "services.engine.sim_engine"),
    # command-line tools the tests start by the dozen: pyplot waits until a report is drawn
    "kvfleet sim run, bench serve, capacity": ("services.cli.sim_cmd", "loadtests.cli",
                                               "services.cli.capacity_cmd", "loadtests.report"),
}


def imported_heavy(modules: tuple[str, ...]) -> list[str]:
    """The HEAVY packages a fresh interpreter holds after importing `modules`."""
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            f"print(json.dumps([p for p in {list(HEAVY)!r} if p in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("modules", list(ENTRIES.values()), ids=list(ENTRIES))
def test_a_simulated_fleets_process_imports_no_model_libraries(modules):
    assert imported_heavy(modules) == []
