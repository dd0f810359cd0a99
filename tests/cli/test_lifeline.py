"""A child of `kvfleet up` dies with it, even one whose stop hangs.

Real processes: a launcher (a Python process) starts a child through services.cli.lifeline, as
`kvfleet up` does, and is killed with SIGKILL. A child that obeys SIGTERM ends at once (the
parent-death signal); a child that ignores SIGTERM (its stop hung) ends once the backstop's
grace has passed, after printing its stacks and why on stderr, with its own exit status.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.cli import lifeline
from services.cli.launcher import running
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]

LAUNCHER = textwrap.dedent("""
    import subprocess, sys
    from services.cli import lifeline
    err = open(sys.argv[1], "wb")
    child = lifeline.SPAWNER.popen(lifeline.command(sys.argv[2:]), stdout=subprocess.PIPE,
                                   stderr=err, env={**__import__("os").environ, **lifeline.env()})
    assert child.stdout.readline().strip() == b"READY"
    print(child.pid, flush=True)
    sys.stdin.read()                  # until killed
""")


@pytest.fixture
def launched(tmp_path):
    """launch(*module_args) -> (launcher, child pid, the child's stderr file); everything is
    killed at the end."""
    started: list[tuple[subprocess.Popen, int]] = []

    def launch(*module_args: str) -> tuple[subprocess.Popen, int, Path]:
        err = tmp_path / f"child{len(started)}.err"
        proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(err), *module_args],
                                cwd=ROOT,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        child = int(proc.stdout.readline())
        started.append((proc, child))
        return proc, child, err
    yield launch
    for proc, child in started:
        proc.kill()
        proc.wait()
        if running(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_that_obeys_sigterm_ends_with_its_launcher_at_once(launched):
    launcher, child, _ = launched("tests.cli.stubborn_child")
    launcher.kill()
    launcher.wait()
    assert wait_until(lambda: not running(child), lifeline.ORPHAN_GRACE_S / 2)


def test_a_child_whose_stop_hangs_ends_after_the_grace_and_says_why(launched):
    launcher, child, err = launched("tests.cli.stubborn_child", "--hang")
    launcher.kill()
    launcher.wait()
    assert running(child), "SIGTERM alone does not stop it"
    assert wait_until(lambda: not running(child), lifeline.ORPHAN_GRACE_S + 10)
    said = err.read_text()
    assert f"still running {lifeline.ORPHAN_GRACE_S:g} s after its launcher" in said, said
    assert "most recent call first" in said, said                  # faulthandler's stacks
