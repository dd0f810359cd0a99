"""Start and stop the fleet's child processes (used by `kvfleet up` and by the fleet tests).

Each child prints one `READY <name> <host:port>` line on stdout when it serves. The launcher reads
stdout on a thread (so pipes never fill), waits for that line, and on stop sends SIGTERM to every
child, then SIGKILL to any that outlive the grace period. Children run in their own process group
so a stop also reaches anything they started.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from services.protocol import fleet_token


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    module_args: list[str] = field(default_factory=list)   # how it was started (to restart it)
    address: str = ""
    ready: threading.Event = field(default_factory=threading.Event)
    lines: list[str] = field(default_factory=list)


class LaunchError(RuntimeError):
    pass


class Launcher:
    def __init__(self, env: dict[str, str] | None = None, log_dir: str | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # one fleet token for every child (and a restarted one): the environment's, or a new one
        self.env = {**env, **fleet_token.child_env(env)}
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvfleet-logs-")
        self.children: dict[str, Child] = {}

    def start(self, name: str, module_args: list[str], ready_timeout_s: float = 120.0) -> str:
        """Run `python -m <module_args...>`; returns the address from its READY line."""
        child = self.spawn(name, module_args)
        log_path = self.log_path(name)
        proc = child.proc
        if not child.ready.wait(ready_timeout_s) or not child.address:
            self.stop(name)
            raise LaunchError(f"{name} did not become ready in {ready_timeout_s:.0f}s "
                              f"(exit code {proc.poll()}); its log {log_path} ends:\n"
                              + _tail(log_path))
        return child.address

    def spawn(self, name: str, module_args: list[str]) -> Child:
        """Start `python -m <module_args...>` without waiting for it; a child of the same name that
        ran before (and died) is replaced. Its stderr is appended to the child's log."""
        with open(self.log_path(name), "ab") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", *module_args], stdout=subprocess.PIPE,
                                    stderr=stderr, stdin=subprocess.DEVNULL, env=self.env,
                                    start_new_session=True, text=True)
        child = self.children[name] = Child(name, proc, list(module_args))
        threading.Thread(target=self._pump, args=(child,), daemon=True).start()
        return child

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def _pump(self, child: Child) -> None:
        for line in child.proc.stdout:
            child.lines.append(line.rstrip())
            if line.startswith("READY ") and not child.ready.is_set():
                child.address = line.split()[-1]
                child.ready.set()
        child.ready.set()   # exited: wake the waiter (address stays empty)

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash would (fault tests)."""
        child = self.children[name]
        _signal_group(child.proc, signal.SIGKILL)
        child.proc.wait(timeout=10)

    def stop(self, name: str, grace_s: float = 10.0) -> None:
        child = self.children.pop(name, None)
        if child is None or child.proc.poll() is not None:
            return
        _signal_group(child.proc, signal.SIGTERM)
        try:
            child.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(child.proc, signal.SIGKILL)
            child.proc.wait(timeout=10)

    def stop_all(self, grace_s: float = 10.0) -> None:
        for name in reversed(list(self.children)):
            self.stop(name, grace_s)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _tail(path: str, lines: int = 15) -> str:
    with open(path, "rb") as f:
        return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
