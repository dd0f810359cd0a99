"""Children that die with their launcher: a parent-death signal set in the child before it runs.

`kvfleet up` starts every child in its own session (so that its stop can signal a child's group),
which also takes the children out of the reach of a terminal's hangup: without more, `kill -9` of
`kvfleet up` would leave the whole fleet serving, ports held, with no one to stop it.

`die_with_parent(sig)` is a `preexec_fn` for subprocess.Popen: in the forked child, before exec,
it asks the kernel (prctl PR_SET_PDEATHSIG) to send `sig` to the child when its parent goes. The
kernel ties that signal to the parent *thread* that forked, not its process: a child forked by a
thread that ends is signalled then. `Spawner` runs every Popen on one thread that lives as long as
the process, so a launcher may start children from any thread (the supervisor's, a test's).

If the parent is already gone by the time the child asks (it died between fork and prctl), the
child sends the signal to itself.
"""
from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Future

PR_SET_PDEATHSIG = 1          # <linux/prctl.h>

_libc = ctypes.CDLL(None, use_errno=True)   # loaded here, in the parent: nothing to load after fork


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn: the child gets `sig` when the thread that forked it ends."""
    parent = os.getpid()

    def arm() -> None:
        if _libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:          # the parent died before the signal was armed
            os.kill(os.getpid(), sig)
    return arm


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
