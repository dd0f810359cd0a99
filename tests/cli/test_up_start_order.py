"""How `kvfleet up` starts its children (services/cli/up.py start_fleet): workers and routers side
by side, the gateway as soon as the routers serve (it needs nothing of the workers, so it loads
while they still load theirs), and the fleet counts as started once every one of them serves. A
worker that fails meanwhile fails the start, and nothing started for it is left running (the
gateway included, when the routers were ready first). Every fleet test starts its fleet this way,
so the way that succeeds needs no story of its own."""
from __future__ import annotations

import argparse

import pytest

from services.cli.launcher import LaunchError, Launcher, running
from services.cli.up import add_up_args, start_fleet
from services.state import redis_auth


def up_args(model, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_up_args(p)
    return p.parse_args(["--model", str(model), "--mode", "colocated", *argv])


class RecordingLauncher(Launcher):
    """A real Launcher that also keeps every child it spawned (a stopped one leaves `children`)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.spawned = []

    def spawn(self, name, module_args):
        child = super().spawn(name, module_args)
        self.spawned.append(child)
        return child


def launcher_for(redis_url: str) -> tuple[RecordingLauncher, str]:
    """A launcher whose children get the session Redis's credentials, and its bare URL."""
    bare, env = redis_auth.child_env(redis_url)
    return RecordingLauncher(env=env), bare


def test_a_worker_that_fails_to_start_fails_the_start_and_stops_what_started_meanwhile(
        tiny_model_dir, redis_url):
    launcher, bare = launcher_for(redis_url)
    broken = up_args(tiny_model_dir, "--engine", "sim", "--sim-kv-tokens", "0")  # refused
    try:
        with pytest.raises(LaunchError, match="mixed-0: it exited with status 1 before READY"):
            start_fleet(broken, launcher, bare)
        assert launcher.children == {}
        assert not [c.name for c in launcher.spawned if running(c.proc.pid)]
    finally:
        launcher.stop_all()
