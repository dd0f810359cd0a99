"""Keep `kvfleet up`'s children running: a child that exits is restarted, with backoff.

Only Ctrl-C / SIGTERM to `kvfleet up` stops the fleet; any one child (gateway, router, a worker)
dying, whatever its exit status, is logged and restarted while the rest keep serving (except a
worker being drained, `retire`: services/cli/fleet_orders.py; its exit is its end):

  died at t, after running u seconds
    -> failures = 0 if u >= stable_after_s else failures + 1
    -> restarted at t + min(max_backoff_s, initial_backoff_s * 2 ** (failures - 1)) (first: initial)

A restarted child is started with the arguments it first ran with plus its `pinned` arguments,
the listening ports it got the first time, so that the gateway's `--router` addresses and clients'
URLs stay valid across restarts (workers are found through Redis, but keep their port too).
What the other services do meanwhile: a request on a dead worker ends with UNAVAILABLE (an SSE
error event once streaming), a prefill that fails before its first token is retried elsewhere,
a dead router is off every stream's path (the gateway asks another router, and reconnects to
the restarted one). Stopping is the launcher's (services/cli/launcher.py); the supervisor only
restarts.

A child that stops answering without exiting (frozen by SIGSTOP, deadlocked, a worker whose engine
core stalled) is probed (`health`, services/cli/health_watch.py): once it has gone
`unresponsive_s` (Timeouts.unresponsive_s) without a healthy answer it is SIGKILLed, with its
process group (a stopped process acts on no SIGTERM until it is continued; SIGKILL it cannot
ignore), and restarted as any child that died.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.cli.health_watch import HealthWatch
from services.cli.launcher import Launcher


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0      # a child up this long counts as healthy: backoff resets
    unresponsive_s: float = 30.0      # no healthy answer this long: SIGKILL, then restart


@dataclass
class _Track:
    started_at: float
    failures: int = 0                 # deaths in a row, each before stable_after_s
    restart_at: float | None = None   # set while the child is dead and waiting for its restart
    restarts: int = 0


@dataclass
class Supervisor:
    launcher: Launcher
    policy: RestartPolicy = RestartPolicy()
    clock: Callable[[], float] = time.monotonic
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    pinned: dict[str, list[str]] = field(default_factory=dict)   # name -> args added on restart
    health: HealthWatch | None = None        # None: only exits are noticed
    _tracks: dict[str, _Track] = field(default_factory=dict)
    retiring: set[str] = field(default_factory=set)   # draining: not restarted when they exit
    retired: list[str] = field(default_factory=list)  # drained and gone

    def retire(self, name: str) -> None:
        """`name` is being drained: once it exits it leaves the fleet instead of restarting."""
        self.retiring.add(name)

    def restarts(self, name: str) -> int:
        track = self._tracks.get(name)
        return track.restarts if track else 0

    def poll(self) -> list[str]:
        """One pass: notice children that died, restart those whose backoff is over. Returns the
        names restarted in this pass."""
        now = self.clock()
        restarted = []
        for name, child in list(self.launcher.children.items()):
            track = self._tracks.setdefault(name, _Track(started_at=now))
            if name in self.retiring:
                self._retire_if_gone(name, child)
                continue
            if track.restart_at is None and child.proc.poll() is None:
                self._check_health(name, child, now)
            status = child.proc.poll()
            if status is not None and track.restart_at is None:
                self._died(name, track, status, now)
            if track.restart_at is not None and now >= track.restart_at:
                self.launcher.spawn(name, child.module_args + self._pins(name, child.module_args))
                track.started_at, track.restart_at = now, None
                track.restarts += 1
                restarted.append(name)
        return restarted

    def _retire_if_gone(self, name: str, child) -> None:
        status = child.proc.poll()
        if status is None:
            return
        self.launcher.children.pop(name, None)
        self._tracks.pop(name, None)
        self.pinned.pop(name, None)
        self.retiring.discard(name)
        self.retired.append(name)
        self.say(f"kvfleet up: {name} drained and exited with status {status}")

    def _check_health(self, name: str, child, now: float) -> None:
        """SIGKILL (its whole group) a running child that answered no probe for unresponsive_s;
        this same poll then sees it dead and schedules its restart."""
        silent_s = self.health.silent_s(name, child, now) if self.health is not None else None
        if silent_s is None or silent_s <= self.policy.unresponsive_s:
            return
        self.say(f"kvfleet up: {name} has not answered its health check for {silent_s:.1f}s "
                 f"(unresponsive_s {self.policy.unresponsive_s:g}); killing it (SIGKILL)")
        self.health.forget(name)
        self.launcher.kill(name)

    def _died(self, name: str, track: _Track, status: int, now: float) -> None:
        up_s = now - track.started_at
        track.failures = 1 if up_s >= self.policy.stable_after_s else track.failures + 1
        delay = min(self.policy.max_backoff_s,
                    self.policy.initial_backoff_s * 2 ** (track.failures - 1))
        track.restart_at = now + delay
        self.say(f"kvfleet up: {name} exited with status {status} after {up_s:.1f}s; "
                 f"restarting it in {delay:.1f}s (restart {track.restarts + 1}; "
                 f"log {self.launcher.log_path(name)})")

    def _pins(self, name: str, args: list[str]) -> list[str]:
        pins = self.pinned.get(name, [])
        return [] if _ends_with(args, pins) else pins


def _ends_with(args: list[str], tail: list[str]) -> bool:
    return not tail or args[-len(tail):] == tail
