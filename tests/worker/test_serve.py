"""A worker as the fleet runs it (`kvfleet serve decode`): a server process and its engine
core process. SIGTERM stops both within 3 s, exit 0; a core that dies takes the worker down with
ENGINE_FAILED_EXIT (70) so that the supervisor restarts it."""
from __future__ import annotations

import os
import signal
import time

import pytest

from services.worker.serve import ENGINE_FAILED_EXIT
from tests.harness import worker_process

START_DEADLINE_S = 60.0
STOP_DEADLINE_S = 3.0


@pytest.fixture
def worker(tiny_model_dir, tmp_path):
    """A decode worker on the tiny model, READY; always killed (with its core) afterwards."""
    with open(tmp_path / "worker.stderr", "w+") as stderr, worker_process(
            tiny_model_dir, "decode", "--kv-cache-mib", "16", "--kv-backend", "tcp",
            stderr=stderr, ready_s=START_DEADLINE_S) as (proc, _):
        proc.core_pid = _engine_core_of(proc.pid)
        proc.stderr_file = stderr
        yield proc


def test_sigterm_stops_the_server_and_its_engine_core_within_3_s(worker):
    t0 = time.monotonic()
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(STOP_DEADLINE_S) == 0, _tail(worker.stderr_file)
    _wait_gone(worker.core_pid, t0 + STOP_DEADLINE_S)


def test_a_killed_engine_core_ends_the_worker_with_engine_failed_exit(worker):
    os.kill(worker.core_pid, signal.SIGKILL)
    assert worker.wait(10) == ENGINE_FAILED_EXIT
    assert "killed by signal 9" in _tail(worker.stderr_file)


def test_a_worker_killed_outright_takes_its_engine_core_and_run_directory_with_it(worker):
    run_dir = open(f"/proc/{worker.core_pid}/cmdline", "rb").read().split(b"\0")[3].decode()
    assert os.path.isdir(run_dir)
    worker.kill()                                        # no cleanup of its own
    worker.wait(10)
    _wait_gone(worker.core_pid, time.monotonic() + STOP_DEADLINE_S)
    assert not os.path.exists(run_dir)                   # the orphaned core removed it


def _engine_core_of(pid: int) -> int:
    """The worker's engine core: its child running services.worker.engine_core."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"services.worker.engine_core" in cmdline:
            return int(entry)
    raise AssertionError(f"worker {pid} has no engine core process")


def _gone(pid: int) -> bool:
    """Exited (a zombie whose parent has not reaped it yet counts as gone)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, deadline: float) -> None:
    while not _gone(pid):
        assert time.monotonic() < deadline, f"engine core {pid} still running"
        time.sleep(0.02)


def _tail(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()[-3000:]


def test_a_worker_names_the_budget_it_runs_and_where_it_came_from(tmp_path):
    """A prefill worker runs the prefill role's larger budget, with or without --config, unless its
    file sets one: one source for the role's defaults (role_scheduler), and the log says which
    file set the rest."""
    import argparse

    from services.engine.config import PREFILL_ROLE_DEFAULTS
    from services.worker.serve import add_worker_args, config_line, engine_config_for
    p = argparse.ArgumentParser()
    add_worker_args(p)
    role_budget = f"token_budget {PREFILL_ROLE_DEFAULTS['token_budget']}, chunk_size " \
                  f"{PREFILL_ROLE_DEFAULTS['chunk_size']}"
    prefill = p.parse_args(["prefill"])
    line = config_line("prefill-0", prefill, engine_config_for(prefill))
    assert role_budget in line and "(the prefill role's defaults, no --config)" in line
    (tmp_path / "classes.yaml").write_text("scheduler:\n  drr_quantum: 64\n")
    prefill = p.parse_args(["prefill", "--config", str(tmp_path / "classes.yaml")])
    line = config_line("prefill-0", prefill, engine_config_for(prefill))
    assert role_budget in line and "classes.yaml, the prefill role's defaults" in line
    (tmp_path / "engine.yaml").write_text("scheduler:\n  token_budget: 384\n  chunk_size: 32\n")
    for role in ("prefill", "decode"):
        args = p.parse_args([role, "--config", str(tmp_path / "engine.yaml")])
        line = config_line(f"{role}-0", args, engine_config_for(args))
        assert "token_budget 384, chunk_size 32" in line and "engine.yaml" in line


def test_a_worker_process_is_not_offered_the_in_process_kv_backend(capsys):
    """`local` moves blocks between pools of one process: no two workers could share it."""
    import argparse

    from services.worker.serve import add_worker_args
    p = argparse.ArgumentParser()
    add_worker_args(p)
    assert p.parse_args(["decode", "--kv-backend", "nixl"]).kv_backend == "nixl"
    with pytest.raises(SystemExit):
        p.parse_args(["decode", "--kv-backend", "local"])
    assert "invalid choice: 'local'" in capsys.readouterr().err
