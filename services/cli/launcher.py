"""Start and stop the fleet's child processes (used by `kvfleet up` and by the fleet tests).

Each child prints one `READY <name> <host:port>` line on stdout when it serves. The launcher reads
stdout on a thread (so pipes never fill) and waits for that line (`start_many` starts children
side by side and waits for all of them; `stopping` aborts the wait).

Stopping (R2, item 9: every process gone within SHUTDOWN_BUDGET_S of SIGTERM, streams in flight
or not). Each child runs in its own session, so its process group holds it and whatever it starts
(a worker's engine-core process). `stop_all`:
  1. snapshots the tree under every child (a grandchild that leaves the group is still in it);
  2. sends SIGTERM to every child's group at once (a child's own stop takes its shutdown grace);
  3. waits until nothing of the groups or the tree is alive, at most `grace_s`;
  4. SIGKILLs whatever is left (groups and tree) and reaps the children.

Dying with the launcher: every child gets SIGTERM from the kernel when the launcher is gone, even
by `kill -9` (a parent-death signal, services/cli/lifeline.py), and stops as on any SIGTERM; a
worker's engine core exits once its worker is gone (its stdin reaches EOF).
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.cli import lifeline
from services.cli.lifeline import SPAWNER
from services.protocol import fleet_token
from services.protocol.timeouts import SHUTDOWN_BUDGET_S

# SIGTERM to SIGKILL: the children's own stop (Timeouts.shutdown_grace_s, 1 s by default) and their
# exit fit in it, and SIGKILL, the reaping and this process's own exit fit in what is left.
STOP_GRACE_S = SHUTDOWN_BUDGET_S - 1.0


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
        # Children inherit this process's whole environment, never scrubbed: the OTEL_* variables
        # (traces, services/telemetry/tracing.py) and KVFLEET_METRICS reach every one of them.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # one fleet token for every child (and a restarted one): the environment's, or a new one
        self.env = {**env, **fleet_token.child_env(env)}
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvfleet-logs-")
        self.children: dict[str, Child] = {}
        self.stopping = threading.Event()    # set (by a signal handler): starts give up at once

    def start(self, name: str, module_args: list[str], ready_timeout_s: float = 120.0) -> str:
        """Run `python -m <module_args...>`; returns the address from its READY line."""
        return self.start_many({name: module_args}, ready_timeout_s)[name]

    def start_many(self, specs: dict[str, list[str]],
                   ready_timeout_s: float = 120.0) -> dict[str, str]:
        """Start every `name: module_args` at once, then wait until each is ready; returns their
        addresses. If one fails (or `stopping` is set), all of them are stopped and LaunchError
        names the first that failed, with its log's tail."""
        children = [self.spawn(name, args) for name, args in specs.items()]
        deadline = time.monotonic() + ready_timeout_s
        for child in children:
            while not child.ready.wait(0.05) and time.monotonic() < deadline \
                    and not self.stopping.is_set():
                pass
            if not child.address:
                status = _exit_status(child)         # before the stop below sets one
                self._stop(children, grace_s=STOP_GRACE_S)
                why = ("the launcher is stopping" if self.stopping.is_set() else
                       f"it exited with status {status} before READY" if status is not None else
                       f"it did not become ready in {ready_timeout_s:.0f}s")
                path = self.log_path(child.name)
                raise LaunchError(f"{child.name}: {why}; its log {path} ends:\n" + _tail(path))
        return {child.name: child.address for child in children}

    def spawn(self, name: str, module_args: list[str]) -> Child:
        """Start `python -m <module_args...>` without waiting for it; a child of the same name that
        ran before (and died) is replaced. Its stderr is appended to the child's log."""
        with open(self.log_path(name), "ab") as stderr:
            proc = SPAWNER.popen(lifeline.command(module_args), stdout=subprocess.PIPE,
                                 stderr=stderr, stdin=subprocess.DEVNULL,
                                 env={**self.env, **lifeline.env()}, start_new_session=True,
                                 text=True)
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
        _signal_group(child.proc.pid, signal.SIGKILL)
        child.proc.wait(timeout=10)

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` to the child (SIGUSR1: drain); nothing if it exited meanwhile."""
        _signal_pid(self.children[name].proc.pid, sig)

    def stop(self, name: str, grace_s: float = STOP_GRACE_S) -> None:
        child = self.children.get(name)
        if child is not None:
            self._stop([child], grace_s)

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """Every child and everything it started is gone when this returns, at most grace_s after
        SIGTERM (plus a SIGKILL's worth)."""
        self._stop(list(self.children.values()), grace_s)

    def _stop(self, children: list[Child], grace_s: float) -> None:
        for child in children:
            if self.children.get(child.name) is child:
                del self.children[child.name]
        groups = {child.proc.pid for child in children}
        tree = {p for child in children for p in _tree(child.proc.pid)}
        for pgid in groups:
            _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for child in children:
                child.proc.poll()                 # reap: a zombie child still counts as its group
            if not _alive(groups, tree):
                break
            time.sleep(0.02)
        for pgid in groups:
            _signal_group(pgid, signal.SIGKILL)
        for pid in _alive(groups, tree):          # a grandchild that left its group
            _signal_pid(pid, signal.SIGKILL)
        for child in children:
            child.proc.wait()
        _wait_gone(groups, tree, timeout_s=1.0)    # SIGKILL is delivered, not yet done


def _exit_status(child: Child) -> int | None:
    """The child's exit status, if it exited. Its stdout closing (`ready` set, no address) comes
    a moment before the exit itself: give that moment."""
    try:
        return child.proc.wait(timeout=1.0) if child.ready.is_set() else child.proc.poll()
    except subprocess.TimeoutExpired:
        return None


def descendants(pid: int) -> list[int]:
    """Every live process under `pid` (children, grandchildren, ...), read from /proc."""
    return [p.pid for p in _tree(pid)]


def children(pid: int) -> list[int]:
    """The live (not zombie) children of `pid`, read from /proc."""
    return [p.pid for p in _processes() if p.ppid == pid]


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    return any(p.pid == pid for p in _processes())


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int = field(compare=False)
    pgid: int = field(compare=False)
    started: int = 0          # clock ticks after boot: a pid reused meanwhile is another process


def _tree(pid: int) -> list[_Proc]:
    by_parent: dict[int, list[_Proc]] = {}
    for p in _processes():
        by_parent.setdefault(p.ppid, []).append(p)
    found, todo = [], [pid]
    while todo:
        kids = by_parent.get(todo.pop(), [])
        found += kids
        todo += [k.pid for k in kids]
    return found


def _processes() -> Iterable[_Proc]:
    """Every process on the host that is not a zombie (a zombie holds no port and runs nothing)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue                               # gone meanwhile
        if fields[0] not in ("Z", "X"):            # fields: state ppid pgrp ... starttime (20th)
            yield _Proc(int(entry), int(fields[1]), int(fields[2]), int(fields[19]))


def _alive(groups: set[int], tree: set[_Proc]) -> list[int]:
    return [p.pid for p in _processes() if p.pgid in groups or p in tree]


def _wait_gone(groups: set[int], tree: set[_Proc], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(groups, tree) and time.monotonic() < deadline:
        time.sleep(0.005)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: str, lines: int = 15) -> str:
    with open(path, "rb") as f:
        return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")

