"""Fault injection for the fault suite (tests/faults/): off unless an environment variable names a
fault. Production processes never set these; they exist so that a test can make a real worker
process fail the way a bug would, and check that the fleet survives it. Test-only, all of them:

  KVFLEET_FAULT_ENGINE_STEP=N         the engine's N-th step() (1-based) raises InjectedFault
  KVFLEET_FAULT_ENGINE_SLOW_STEP=N:S  the engine's N-th step() sleeps S seconds, then runs: a long
                                      step (a big prefill on a loaded CPU), during which the core
                                      answers nothing, stats included
  KVFLEET_FAULT_ENGINE_STEP_DELAY=S   every step() sleeps S seconds first: a slower engine, so a
                                      test's kill lands while its streams are still decoding

The engine core process (services/worker/engine_core.py) installs them on its engine; it inherits
the worker's environment. A failure then surfaces like a real one: the core sends a Failure naming
InjectedFault and exits, and the server fails every request with EngineFailed and exits 70.
"""
from __future__ import annotations

import itertools
import time

from services.protocol import env

ENGINE_STEP = env.FAULT_ENGINE_STEP.name
ENGINE_SLOW_STEP = env.FAULT_ENGINE_SLOW_STEP.name
ENGINE_STEP_DELAY = env.FAULT_ENGINE_STEP_DELAY.name


class InjectedFault(RuntimeError):
    """Raised by an injected fault; never by real code."""


def install(engine, environ=None) -> None:
    """Wrap the engine's step() as the environment asks (no-op when nothing is asked)."""
    fail_at = int(env.FAULT_ENGINE_STEP.get(environ)) if env.FAULT_ENGINE_STEP.get(environ) else None
    slow_at, slow_s = _slow_step(env.FAULT_ENGINE_SLOW_STEP.get(environ))
    delay_s = float(env.FAULT_ENGINE_STEP_DELAY.get(environ) or 0.0)
    if fail_at is None and slow_at is None and delay_s <= 0:
        return
    steps, real_step = itertools.count(1), engine.step

    def step():
        n = next(steps)
        if n == fail_at:
            raise InjectedFault(f"injected failure at engine step {fail_at} ({ENGINE_STEP})")
        if n == slow_at:
            time.sleep(slow_s)
        if delay_s > 0:
            time.sleep(delay_s)
        return real_step()

    engine.step = step


def _slow_step(value: str | None) -> tuple[int | None, float]:
    """"N:S" -> (N, S); nothing -> (None, 0)."""
    if not value:
        return None, 0.0
    at, _, seconds = value.partition(":")
    return int(at), float(seconds)
