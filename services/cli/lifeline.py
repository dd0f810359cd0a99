"""Children that die with their launcher: a parent-death signal each child arms as it starts.

`kvfleet up` starts every child in its own session (so that its stop can signal a child's group),
which also takes the children out of the reach of a terminal's hangup: without more, `kill -9` of
`kvfleet up` would leave the whole fleet serving, ports held, with no one to stop it.

A launcher runs a child as `python -m services.cli.lifeline <module> <args...>` (`command`), with
its own pid in the child's environment (`env`). This module, run so, asks the kernel
(prctl PR_SET_PDEATHSIG) to send the child SIGTERM when its parent goes, then runs `<module>` as
`python -m <module> <args...>` would, in the same process (runpy; no second exec). If the parent
is already gone when the child arms it (the launcher died while the child started), the child
sends the signal to itself. The arming is done in the child's own fresh interpreter, not in a
preexec_fn: code run between fork and exec of a process holding threads (grpc's, torch's) can
deadlock or crash.

A child whose stop hangs (a task that will not end, a blocked call) would outlive its launcher
forever: the signal is asked for once. So the child also watches its parent itself (a thread
blocked on the parent's pidfd); ORPHAN_GRACE_S after the parent ended, a child still running
prints every thread's stack on stderr, says why, and ends at once (`os._exit`). The budget of a
stop is SHUTDOWN_BUDGET_S; the backstop waits twice that.

The kernel ties the signal to the parent *thread* that forked, not its process: a child forked by
a thread that ends would be signalled then. `Spawner` runs every Popen on one thread that lives as
long as the process, so a launcher may start children from any thread (the supervisor's, a test's).
"""
from __future__ import annotations

import ctypes
import faulthandler
import os
import queue
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from services.protocol import env as envs
from services.protocol.timeouts import SHUTDOWN_BUDGET_S

PR_SET_PDEATHSIG = 1                     # <linux/prctl.h>
PARENT_ENV = envs.LAUNCHER_PID.name      # the pid the child must outlive by no more than a signal
DEATH_SIGNAL = signal.SIGTERM            # a child stops on it as on any stop (within 3 s)
ORPHAN_GRACE_S = 2 * SHUTDOWN_BUDGET_S   # a child still running this long after its parent ended
ORPHAN_EXIT = 75                         # ... exits with this status (EX_TEMPFAIL)


def command(module_args: list[str]) -> list[str]:
    """The command line of a child that runs `python -m <module_args...>` and dies with us."""
    return [sys.executable, "-m", "services.cli.lifeline", *module_args]


def env() -> dict[str, str]:
    """What the child's environment needs for `command` (this process is its parent)."""
    return {PARENT_ENV: str(os.getpid())}


def arm(parent: int, sig: int = DEATH_SIGNAL) -> None:
    """This process gets `sig` when the thread that forked it ends; at once if `parent` is no
    longer its parent (it ended already)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def watch_parent(parent: int, grace_s: float = ORPHAN_GRACE_S) -> threading.Thread:
    """Start the backstop of the death signal: a daemon thread that waits for `parent` to end,
    then grace_s more, then prints every thread's stack and ends this process (see the module
    docstring). A process that stops in time never hears from it."""
    def watch() -> None:
        try:
            fd = os.pidfd_open(parent)
        except ProcessLookupError:
            fd = None                                   # it ended already
        if fd is not None:
            select.select([fd], [], [])                 # readable once the parent has ended
            os.close(fd)
        time.sleep(grace_s)                             # the stop's own budget, twice
        sys.stderr.write(f"kvfleet: pid {os.getpid()} still running {grace_s:g} s after its "
                         f"launcher (pid {parent}) ended; its stacks, then exit {ORPHAN_EXIT}\n")
        faulthandler.dump_traceback(all_threads=True)
        os._exit(ORPHAN_EXIT)
    thread = threading.Thread(target=watch, name="kvfleet-orphan-watch", daemon=True)
    thread.start()
    return thread


class Spawner:
    """Runs Popen calls on one long-lived daemon thread (see the module docstring)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], subprocess.Popen], Future]] = \
            queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        """subprocess.Popen(*args, **kwargs), run on the spawner thread; raises what it raises."""
        done: Future = Future()
        self._start()
        self._jobs.put((lambda: subprocess.Popen(*args, **kwargs), done))
        return done.result()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvfleet-spawner",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            make, done = self._jobs.get()
            try:
                done.set_result(make())
            except BaseException as e:  # noqa: BLE001 - handed to the caller, raised there
                done.set_exception(e)


SPAWNER = Spawner()           # one per process: its thread is never ended


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m services.cli.lifeline MODULE [ARGS...]")
    parent = envs.LAUNCHER_PID.pop()
    if not parent.isdigit():
        raise SystemExit(f"services.cli.lifeline: {PARENT_ENV} must name the launcher's pid")
    arm(int(parent))
    watch_parent(int(parent))
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]      # run_module sets argv[0] to the module's file
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
