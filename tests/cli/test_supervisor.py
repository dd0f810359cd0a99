"""`kvfleet up`'s supervisor, on real child processes and a driven clock: a child that dies is
restarted after a backoff that doubles while it keeps dying young and resets once it has run long
enough; a restarted child gets its pinned arguments (its port); a child that runs is left alone.
A child frozen by SIGSTOP is SIGKILLed and restarted once it has answered no health probe for the
deadline. And the launcher's stop: every child and grandchild gone within the grace, stubborn or
not."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from services.cli.launcher import Launcher, descendants, running
from tests.waiting import wait_until
from services.cli.health_watch import FleetProbe, HealthWatch
from services.cli.supervisor import RestartPolicy, Supervisor
from services.protocol.fleet_token import FleetAuth

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


# --- a child that stops answering without exiting ------------------------------------------------

HTTP = ["tests.cli.test_supervisor", "http"]    # READY gateway <address>, then serves HTTP


def test_a_frozen_child_is_sigkilled_and_restarted_once_it_answered_no_probe_for_the_deadline(
        launcher):
    """The probe is the real one `kvfleet up` uses on its gateway (GET /metrics; any answer is
    alive); the clock is driven, one second a pass, each pass waiting for its probe's answer."""
    clock, said = Clock(), []
    watch = HealthWatch(FleetProbe(FleetAuth(), timeout_s=0.5), every_s=1.0, clock=clock)
    sup = Supervisor(launcher, RestartPolicy(initial_backoff_s=0.0, unresponsive_s=5.0),
                     clock=clock, say=said.append, health=watch)
    launcher.start("gateway", HTTP)
    frozen = launcher.children["gateway"].proc

    def one_second() -> list[str]:
        restarted = sup.poll()
        assert wait_until(lambda: watch.probing() == 0, 10)
        clock.now += 1.0
        return restarted

    for _ in range(10):                          # answering: left alone however long it runs
        assert one_second() == []
    assert frozen.poll() is None and said == []
    frozen.send_signal(signal.SIGSTOP)
    stopped_at, restarted = clock.now, []
    while not restarted:
        restarted = one_second()
        assert clock.now - stopped_at <= 10, said
    assert restarted == ["gateway"] and frozen.returncode == -signal.SIGKILL
    assert clock.now - stopped_at > 5.0          # not before unresponsive_s
    assert "gateway has not answered its health check" in said[0]
    assert "gateway exited with status -9" in said[1]
    assert launcher.children["gateway"].proc is not frozen


# --- stopping: everything, at once, within the budget --------------------------------------------

STUBBORN = ["tests.cli.test_supervisor", "stubborn"]     # ignores SIGTERM; so do its two children
POLITE = ["tests.cli.test_supervisor", "polite"]         # READY, then dies of SIGTERM


@pytest.mark.serial                     # a claim about time: run alone after the parallel run
def test_stop_all_takes_down_stubborn_children_and_grandchildren_within_the_grace(launcher):
    launcher.start("polite", POLITE)
    launcher.start("stubborn", STUBBORN)
    root = launcher.children["stubborn"].proc.pid
    tree = [root, *descendants(root)]
    assert len(tree) == 3, tree                 # one grandchild in its group, one in its own session
    polite = launcher.children["polite"].proc.pid
    t0 = time.monotonic()
    launcher.stop_all(grace_s=0.5)
    took = time.monotonic() - t0
    assert 0.5 <= took < 1.5, took              # SIGTERM ignored: SIGKILL at the grace, not later
    assert not any(running(pid) for pid in [*tree, polite])
    assert launcher.children == {}


@pytest.mark.serial                     # a claim about time: run alone after the parallel run
def test_children_that_obey_sigterm_are_not_held_for_the_grace(launcher):
    for i in range(3):
        launcher.start(f"polite-{i}", POLITE)
    t0 = time.monotonic()
    launcher.stop_all(grace_s=10)
    assert time.monotonic() - t0 < 2.0


# --- dying with the launcher ---------------------------------------------------------------------

PARENT = ["tests.cli.test_supervisor", "parent"]   # a launcher: starts POLITE from a thread that ends


def test_children_outlive_the_thread_that_started_them_and_die_with_their_launcher(launcher):
    launcher.start("parent", PARENT)
    parent = launcher.children["parent"]
    assert wait_until(lambda: any(line.startswith("CHILD ") for line in parent.lines), 30)
    child = int(next(line for line in parent.lines if line.startswith("CHILD ")).split()[1])
    assert running(child) and "polite" in open(f"/proc/{child}/cmdline").read()
    parent.proc.send_signal(signal.SIGKILL)         # the launcher dies without stopping anything
    assert wait_until(lambda: not running(child), 10), "the child outlived its launcher"


def _parent() -> None:
    import threading
    inner = Launcher()
    starter = threading.Thread(target=inner.start, args=("polite", POLITE))
    starter.start()
    starter.join()                                  # the thread that asked for the child is gone
    print(f"CHILD {inner.children['polite'].proc.pid}", flush=True)
    print("READY parent 127.0.0.1:0", flush=True)
    time.sleep(60)


def _stubborn() -> None:
    """A child that ignores SIGTERM, with one grandchild in its process group and one that left it
    (its own session): what a stop must still take down."""
    ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kids = [subprocess.Popen([sys.executable, "-c", ignore], stdout=subprocess.PIPE,
                             start_new_session=new) for new in (False, True)]
    for kid in kids:
        kid.stdout.readline()
    print("READY stubborn 127.0.0.1:0", flush=True)
    time.sleep(60)


if __name__ == "__main__" and sys.argv[1:] == ["stubborn"]:
    _stubborn()
elif __name__ == "__main__" and sys.argv[1:] == ["parent"]:
    _parent()
elif __name__ == "__main__" and sys.argv[1:] == ["http"]:
    from http.server import HTTPServer, SimpleHTTPRequestHandler
    server = HTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    print(f"READY gateway 127.0.0.1:{server.server_port}", flush=True)
    server.serve_forever()
elif __name__ == "__main__" and sys.argv[1:] == ["polite"]:
    print("READY polite 127.0.0.1:0", flush=True)
    time.sleep(60)
