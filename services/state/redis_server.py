"""Redis servers for single-host runs and tests, both bound to 127.0.0.1 only.

- `EmbeddedRedis`: an in-process Redis-protocol server (fakeredis `TcpFakeServer`, Lua via lupa) served
  from a daemon thread. It is what `kvfleet up` starts when no `--redis-url` is given, so a single-host
  fleet needs no Redis install. Other processes reach it with an ordinary redis-py client at `url`.
- `RedisServerProcess`: a real `redis-server` child process (no persistence, not daemonized, so the
  Popen is kept and `stop()` can end it). Tests use one per session; users can start one on purpose.

Both: `start()` returns once PING answers, `url` is `redis://127.0.0.1:PORT/0`, `stop()` is idempotent
and joins/reaps what `start()` started, and both are context managers.
"""
from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

HOST = "127.0.0.1"


class RedisNotInstalledError(RuntimeError):
    """`redis-server` is not on PATH."""


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the caller may still lose a race for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _ping(port: int) -> bool:
    client = redis.Redis(host=HOST, port=port, socket_connect_timeout=0.2, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False
    finally:
        client.close()


def _wait_for_ping(port: int, timeout_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        if _ping(port):
            return
        time.sleep(0.01)
    raise TimeoutError(f"no PING answer from {HOST}:{port} within {timeout_s} s")


class _ServerBase:
    port: int

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class EmbeddedRedis(_ServerBase):
    """fakeredis over TCP in this process. Lifecycle: start() -> serve thread -> stop() joins it."""

    def __init__(self, port: int = 0, start_timeout_s: float = 5.0):
        self.port = port
        self._start_timeout_s = start_timeout_s
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self) -> "EmbeddedRedis":
        from fakeredis import TcpFakeServer
        if self._server is not None:
            raise RuntimeError("EmbeddedRedis already started")
        # Binding port 0 here (not free_port()) leaves no window for another process to take the port.
        class Server(TcpFakeServer):
            request_queue_size = 128   # socketserver's 5 stalls a burst of connects for ~1 s
        self._server = Server((HOST, self.port), server_type="redis")
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"embedded-redis-{self.port}", daemon=True)
        self._thread.start()
        try:
            _wait_for_ping(self.port, self._start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        server, thread, self._server, self._thread = self._server, self._thread, None, None
        if server is None:
            return
        server.shutdown()       # ends serve_forever and tells connection handlers to exit
        server.server_close()   # closes the listening socket and joins the handler threads
        thread.join()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def _die_with_parent_hook():
    """A preexec_fn: the child gets SIGTERM if the thread that started it dies (Linux PR_SET_PDEATHSIG).
    libc is loaded here, in the parent, so the forked child only makes one call."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class RedisServerProcess(_ServerBase):
    """A `redis-server` child on 127.0.0.1: no RDB/AOF, its own temp dir, log in `<dir>/redis.log`.

    die_with_parent (Linux): the server gets SIGTERM if the *thread* that called start() exits, so a
    killed test run leaves no orphan; start it from a long-lived thread (the main one) or pass False.
    """

    def __init__(self, executable: str | None = None, start_timeout_s: float = 10.0,
                 stop_timeout_s: float = 5.0, die_with_parent: bool = True):
        self.port = 0
        self._executable = executable
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self.process: subprocess.Popen | None = None
        self.dir: Path | None = None

    def _resolve_executable(self) -> str:
        exe = shutil.which(self._executable or "redis-server")
        if exe is None:
            raise RedisNotInstalledError(
                f"{self._executable or 'redis-server'} not found on PATH: install it (`make system-deps`, or "
                "apt-get install redis-server), pass --redis-url to an existing server, or use EmbeddedRedis")
        return exe

    def _command(self, exe: str) -> list[str]:
        return [exe, "--bind", HOST, "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--protected-mode", "yes", "--daemonize", "no", "--dir", str(self.dir),
                "--logfile", str(self.dir / "redis.log")]

    def _spawn(self, exe: str) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(self._command(exe), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        preexec_fn=_die_with_parent_hook() if self._die_with_parent else None)

    def start(self, attempts: int = 3) -> "RedisServerProcess":
        if self.process is not None:
            raise RuntimeError("RedisServerProcess already started")
        exe = self._resolve_executable()
        self.dir = Path(tempfile.mkdtemp(prefix="kvfleet-redis-"))
        for _ in range(attempts):  # retry only if another process took the free port first
            self._spawn(exe)
            try:
                _wait_for_ping(self.port, self._start_timeout_s, alive=lambda: self.process.poll() is None)
                return self
            except TimeoutError:
                self._reap()
        log = self._log_tail()
        self.stop()
        raise RuntimeError(f"redis-server did not start after {attempts} attempts; log tail:\n{log}")

    def _log_tail(self, chars: int = 2000) -> str:
        log = self.dir / "redis.log" if self.dir else None
        return log.read_text(errors="replace")[-chars:] if log and log.exists() else "(no log)"

    def _reap(self) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(self._stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        self._reap()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
