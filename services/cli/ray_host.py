"""The Ray actor that hosts one service of `kvfleet up --ray` (services/cli/ray_fleet.py).

`ServiceHost` runs its service as `kvfleet up` runs a child (a `Launcher` of its own: `python -m
services.cli.lifeline <module> <args...>`, its stdout read for READY, its stderr in the fleet's log
folder), so the service dies with the actor (a parent-death signal). When the service dies the
actor exits with RESTART_STATUS, so that Ray restarts the actor, and with it the service; a
restarted actor says so on its stderr (Ray forwards it to kvfleet up). A service being drained
(SIGUSR1) or stopped ends without that: kvfleet up then kills the actor for good.

A fleet spread over several Ray nodes (`kvfleet up --ray ADDRESS --allow-external-bind`) hosts its
routers and workers with `bind_node`: the service is told to listen on its node's address, the one
Ray knows the node by (`--host <node IP> --allow-external-bind`), so what it advertises (its READY
address, its record in Redis, its tcp KV receiver's descriptors) is reachable from the other nodes,
and NIXL's UCX is pointed at the interface holding that address (`UCX_NET_DEVICES`, unless the
operator set it). Without it a service listens on 127.0.0.1, as in a plain fleet.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import warnings

from services.cli.launcher import Launcher
from services.protocol import bind, env as env_vars

RESTART_STATUS = 1              # an actor whose service died exits with this


class ServiceHost:
    """A Ray actor hosting one service: runs it as `kvfleet up` runs a child, exits when it dies
    (so that Ray restarts the actor), and answers about it."""

    def __init__(self, name: str, module_args: list[str], env: dict[str, str],
                 log_dir: str, bind_node: bool = False) -> None:
        import ray  # noqa: PLC0415
        os.makedirs(log_dir, exist_ok=True)
        self.name = name
        self.draining = False
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        if bind_node:
            module_args, env = on_node(module_args, env, self.node_ip)
        self.launcher = Launcher(env=env, log_dir=log_dir)
        with warnings.catch_warnings():        # deprecated in 2.60, with no replacement yet
            warnings.simplefilter("ignore")
            self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if self.restarted:
            say(f"kvfleet ray: {name}'s actor was restarted by Ray; starting {name} again")
        self.child = self.launcher.spawn(name, module_args)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        status = self.child.proc.wait()
        if self.draining or self.launcher.stopping.is_set():
            return
        say(f"kvfleet ray: {self.name} exited with status {status}; its actor exits so that "
             f"Ray restarts it (log {self.launcher.log_path(self.name)})")
        os._exit(RESTART_STATUS)

    def ready(self, timeout_s: float) -> dict:
        """Once the service printed READY (or exited, or `timeout_s` passed): `info()`."""
        self.child.ready.wait(timeout_s)
        return self.info()

    def info(self) -> dict:
        return {"address": self.child.address, "lines": list(self.child.lines),
                "pid": self.child.proc.pid, "status": self.child.proc.poll(),
                "draining": self.draining, "restarted": self.restarted,
                "node_id": self.node_id, "node_ip": self.node_ip,
                "log_tail": _tail(self.launcher.log_path(self.name))}

    def signal(self, sig: int) -> None:
        """Pass `sig` to the service; SIGUSR1 (drain) makes its exit the actor's end."""
        if sig == signal.SIGUSR1:
            self.draining = True
        try:
            os.kill(self.child.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the service's process group, as a crash would; the actor then exits (its
        watcher sees the death) and Ray restarts it. Returns before that exit."""
        try:
            os.killpg(self.child.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float) -> None:
        self.launcher.stopping.set()
        self.launcher.stop_all(grace_s)


def on_node(module_args: list[str], env: dict[str, str], node_ip: str
            ) -> tuple[list[str], dict[str, str]]:
    """A router's or worker's command and environment to listen on `node_ip`: the last --host
    wins in its arguments, and UCX uses the interface that holds `node_ip` (loopback: `lo`)
    unless the environment names one already."""
    env = dict(env)
    if not env.get(env_vars.UCX_NET_DEVICES.name):
        device = interface_of(node_ip)
        if device:
            env[env_vars.UCX_NET_DEVICES.name] = device
    return [*module_args, "--host", node_ip, bind.FLAG], env


def interface_of(ip: str) -> str | None:
    """The name of the network interface that holds address `ip` (None: no interface does)."""
    import psutil  # noqa: PLC0415
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addresses):
            return name
    return None


def say(line: str) -> None:
    """One line on stderr, at once (Ray forwards an actor's stderr to kvfleet up)."""
    print(line, file=sys.stderr, flush=True)


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return ""
