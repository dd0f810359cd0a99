"""`kvfleet up`'s supervisor, on real child processes and a driven clock: a child that dies is
restarted after a backoff that doubles while it keeps dying young and resets once it has run long
enough; a restarted child gets its pinned arguments (its port); a child that runs is left alone."""
from __future__ import annotations

import signal

import pytest

from services.cli.launcher import Launcher, wait_until
from services.cli.supervisor import RestartPolicy, Supervisor

DIES_AT_ONCE = ["json.tool", "/nonexistent/kvfleet-supervisor-test"]   # exits 2 straight away
RUNS = ["http.server", "--bind", "127.0.0.1", "0"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def launcher():
    launcher = Launcher()
    yield launcher
    launcher.stop_all(grace_s=2)


def dead(launcher: Launcher, name: str) -> bool:
    return wait_until(lambda: launcher.children[name].proc.poll() is not None, 10)


def test_a_child_that_keeps_dying_is_restarted_with_doubling_backoff(launcher):
    clock, said = Clock(), []
    sup = Supervisor(launcher, RestartPolicy(initial_backoff_s=0.5, max_backoff_s=2.0),
                     clock=clock, say=said.append)
    launcher.spawn("flaky", DIES_AT_ONCE)
    waits = []
    for _ in range(4):
        assert dead(launcher, "flaky")
        assert sup.poll() == []                 # death noticed, restart scheduled
        died_at, waited = clock.now, 0.0
        while not sup.poll():
            clock.now += 0.25
            waited = clock.now - died_at
            assert waited <= 2.0, "restarted no later than max_backoff_s"
        waits.append(waited)
    assert waits == [0.5, 1.0, 2.0, 2.0]
    assert sup.restarts("flaky") == 4
    assert all("flaky exited with status 2" in line for line in said) and len(said) == 4


def test_a_child_that_ran_long_enough_restarts_after_the_initial_backoff(launcher):
    clock = Clock()
    sup = Supervisor(launcher, RestartPolicy(initial_backoff_s=0.5, stable_after_s=60.0),
                     clock=clock, say=lambda _: None)
    launcher.spawn("steady", RUNS)
    for _ in range(3):
        sup.poll()
        assert launcher.children["steady"].proc.poll() is None   # running: left alone
        clock.now += 61.0                                          # ... for over a minute
        launcher.children["steady"].proc.send_signal(signal.SIGKILL)
        assert dead(launcher, "steady")
        sup.poll()
        clock.now += 0.5
        assert sup.poll() == ["steady"]                            # backoff never grew


def test_a_restarted_child_gets_its_pinned_arguments_once(launcher):
    clock = Clock()
    sup = Supervisor(launcher, RestartPolicy(initial_backoff_s=0.0), clock=clock,
                     say=lambda _: None, pinned={"flaky": ["--indent", "2"]})
    launcher.spawn("flaky", DIES_AT_ONCE)
    for _ in range(2):
        assert dead(launcher, "flaky")
        sup.poll()
    assert launcher.children["flaky"].module_args == DIES_AT_ONCE + ["--indent", "2"]
