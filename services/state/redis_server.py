"""Redis servers for single-host runs and tests, both bound to 127.0.0.1 only.

- `EmbeddedRedis`: an in-process Redis-protocol server (fakeredis `TcpFakeServer`, Lua via lupa) served
  from a daemon thread. It is what `kvfleet up` starts when no `--redis-url` is given, so a single-host
  fleet needs no Redis install. Other processes reach it with an ordinary redis-py client at `url`.
- `RedisServerProcess`: a real `redis-server` child process (no persistence, not daemonized, so the
  Popen is kept and `stop()` can end it). Tests use one per session; users can start one on purpose.

Both: `start()` returns once PING answers, `url` is `redis://127.0.0.1:PORT/0`, `stop()` is idempotent
and joins/reaps what `start()` started, and both are context managers.

Password (`password=`): clients must AUTH first; `auth_url` is `url` with the password in it (for a
client in this process; a child gets the password in its environment, services/state/redis_auth.py).
`RedisServerProcess` reads it from a config file only its user can read, never from its command line.
fakeredis keeps a `requirepass` setting but enforces nothing (every connection starts as the
default user, which may run anything), so `EmbeddedRedis` enforces it with fakeredis's own ACL
model: the default user gets the password, and each new connection starts as a user that may run
no command but AUTH until it authenticates (`_AuthRequiredHandler`).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

import redis

HOST = "127.0.0.1"


class RedisNotInstalledError(RuntimeError):
    """`redis-server` is not on PATH."""


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the caller may still lose a race for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _ping(port: int, password: str | None = None) -> bool:
    client = redis.Redis(host=HOST, port=port, password=password, socket_connect_timeout=0.2,
                         socket_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError, redis.ResponseError):
        return False
    finally:
        client.close()


def _wait_for_ping(port: int, timeout_s: float, alive=lambda: True,
                   password: str | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        if _ping(port, password):
            return
        time.sleep(0.01)
    raise TimeoutError(f"no PING answer from {HOST}:{port} within {timeout_s} s")


class _ServerBase:
    port: int
    password: str | None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def auth_url(self) -> str:
        """`url` with the password in it (`url` itself if there is none)."""
        if not self.password:
            return self.url
        return f"redis://:{quote(self.password, safe='')}@{HOST}:{self.port}/0"

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# The user a connection of a password-protected EmbeddedRedis is until it AUTHs: fakeredis's ACL
# lets it run AUTH and HELLO only. Nobody can AUTH as it (it has no password).
UNAUTHENTICATED_USER = "kvfleet-unauthenticated"


def _auth_required_handler():
    from fakeredis._clients._tcp_server import TCPFakeRequestHandler

    class _AuthRequiredHandler(TCPFakeRequestHandler):
        """Each connection starts unauthenticated; AUTH (or HELLO's AUTH) makes it the user it
        names. fakeredis's own HELLO checks the password it is given but switches no user: the
        connection's HELLO runs AUTH first (redis-py 8 speaks RESP3, so it authenticates so)."""

        def setup(self) -> None:
            super().setup()
            sock = self.current_client.get_socket()
            sock._client_info["user"] = UNAUTHENTICATED_USER
            sock.hello = _hello_with_auth(sock)
    return _AuthRequiredHandler


def _hello_with_auth(sock):
    hello = sock.hello

    def run(*args: bytes):
        args = list(args)
        for i in range(1, len(args) - 2):
            if args[i].upper() == b"AUTH":
                sock._auth(args[i + 1], args[i + 2])   # WRONGPASS unless the password is right
                del args[i:i + 3]
                break
        return hello(*args)
    return run


def _require_password(server, password: str) -> None:
    """Set up fakeredis server `server` (a TcpFakeServer) so that every command needs AUTH."""
    fake = server.fake_server
    fake.config[b"requirepass"] = password.encode()                      # `AUTH <password>`
    fake.acl.get_user_acl(b"default").add_password(password.encode())   # no longer `nopass`
    fake.acl.get_user_acl(UNAUTHENTICATED_USER.encode()).add_command_or_category(b"+hello")
    server.RequestHandlerClass = _auth_required_handler()


class EmbeddedRedis(_ServerBase):
    """fakeredis over TCP in this process. Lifecycle: start() -> serve thread -> stop() joins it."""

    def __init__(self, port: int = 0, start_timeout_s: float = 5.0, password: str | None = None):
        self.port = port
        self.password = password
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
        if self.password:
            _require_password(self._server, self.password)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"embedded-redis-{self.port}", daemon=True)
        self._thread.start()
        try:
            _wait_for_ping(self.port, self._start_timeout_s, password=self.password)
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
                 stop_timeout_s: float = 5.0, die_with_parent: bool = True,
                 password: str | None = None):
        self.port = 0
        self.password = password
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

    def _config(self) -> str:
        """redis.conf: the settings, the password among them (a file, not the command line)."""
        lines = [f"bind {HOST}", f"port {self.port}", 'save ""', "appendonly no",
                 "protected-mode yes", "daemonize no", f'dir "{self.dir}"',
                 f'logfile "{self.dir / "redis.log"}"']
        if self.password:
            escaped = self.password.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'requirepass "{escaped}"')
        return "\n".join(lines) + "\n"

    def _command(self, exe: str) -> list[str]:
        path = self.dir / "redis.conf"
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(self._config())
        return [exe, str(path)]

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
                _wait_for_ping(self.port, self._start_timeout_s,
                               alive=lambda: self.process.poll() is None, password=self.password)
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
