"""`kvfleet up` as a user runs it, for the tests that need a whole fleet (tests/cli, tests/telemetry)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager

from services.cli.launcher import descendants
from services.cli.up import read_banner
from services.state import redis_auth
from services.state.redis_server import free_port


# The embedded Redis's password of every `kvfleet up` these tests start (it takes the one in its
# environment): `redis_env()` gives it to a test's own `kvfleet status` or Redis client.
REDIS_PASSWORD = redis_auth.generate()


def redis_env() -> dict[str, str]:
    return {**os.environ, redis_auth.ENV_PASSWORD: REDIS_PASSWORD}


@contextmanager
def kvfleet_up(model_dir, *args: str, env: dict[str, str] | None = None):
    """`kvfleet up` on free ports; yields (process, http port, the lines up to READY; later lines
    keep being appended). `env` is added to this process's environment for the whole fleet; its
    embedded Redis's password is REDIS_PASSWORD.
    Whatever happens, its whole session is SIGKILLed afterwards if anything of it is left."""
    http = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.cli", "up", "--model", str(model_dir),
         "--http-port", str(http), "--grpc-port", str(free_port()), "--kv-cache-mib", "32", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**redis_env(), **(env or {})})
    tree = []
    try:
        lines = read_banner(proc.stdout).lines
        threading.Thread(target=lambda: [lines.append(x.rstrip()) for x in proc.stdout],
                         daemon=True).start()
        tree = descendants(proc.pid)
        yield proc, http, lines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in tree:
            kill(pid)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
