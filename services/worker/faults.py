"""Fault injection for the fault suite (tests/faults/): off unless an environment variable names a
fault. Production processes never set these; they exist so that a test can make a real worker
process fail the way a bug would, and check that the fleet survives it.

  KVFLEET_FAULT_ENGINE_STEP=N   the engine's N-th step() (1-based) raises InjectedFault

The engine core process (services/worker/engine_core.py) installs them on its engine; it inherits
the worker's environment. The fault then surfaces like a real one: the core sends a Failure naming
InjectedFault and exits, and the server fails every request with EngineFailed and exits 70.
"""
from __future__ import annotations

import itertools
import os

ENGINE_STEP = "KVFLEET_FAULT_ENGINE_STEP"


class InjectedFault(RuntimeError):
    """Raised by an injected fault; never by real code."""


def install(engine, environ=os.environ) -> None:
    """Wrap the engine's step() as the environment asks (no-op when nothing is asked)."""
    at = environ.get(ENGINE_STEP)
    if not at:
        return
    fail_at, steps, real_step = int(at), itertools.count(1), engine.step

    def step():
        if next(steps) == fail_at:
            raise InjectedFault(f"injected failure at engine step {fail_at} ({ENGINE_STEP})")
        return real_step()

    engine.step = step
