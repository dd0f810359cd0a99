"""`kvfleet demo`, run as a user would: it reports TTFT and ITL per class in process on the tiny
model and through the fleet on the simulated engine core (`--engine sim`: the table's rows are
counts and times, whatever makes the tokens); on the real model (SmolLM2-135M-Instruct) the fleet
demo's chats get real answers, printed before the table."""
from __future__ import annotations

import re
import subprocess
import sys

# a table row: class, requests, errors, TTFT p50/p99 in ms, ITL p50/p99 in ms
FLEET_ROW = re.compile(r"^(interactive|document)\s+(\d+)\s+(\d+)\s+\d+ms\s+\d+ms\s+[\d.]+ms\s+[\d.]+ms$")
ENGINE_ROW = re.compile(r"^(interactive|document)\s+(\d+)\s+\d+ms\s+\d+ms\s+[\d.]+ms\s+[\d.]+ms\s+\d+$")


def demo(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`kvfleet demo ...` to its end; its own `finally` stops the fleet it started (and on a
    timeout the subprocess is killed, and `run` reaps it)."""
    return subprocess.run([sys.executable, "-m", "services.cli.cli", "demo", *args],
                          capture_output=True, text=True, timeout=timeout)


def rows(stdout: str, pattern: re.Pattern) -> dict[str, tuple[str, ...]]:
    return {m[1]: m.groups()[1:] for m in map(pattern.match, stdout.splitlines()) if m}


def test_the_fleet_demo_on_the_simulated_core_reports_ttft_and_itl_per_class(tiny_model_dir):
    run = demo("--fleet", "--engine", "sim", "--model", str(tiny_model_dir), "--chats", "6",
               "--rate", "20", "--documents", "1", "--doc-tokens", "512")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "simulated engine core" in run.stdout
    table = rows(run.stdout, FLEET_ROW)
    assert table == {"interactive": ("6", "0"), "document": ("1", "0")}, run.stdout
    assert "fleet stopped" in run.stdout


def test_the_simulated_core_without_the_fleet_is_a_usage_error(tiny_model_dir):
    run = demo("--engine", "sim", "--model", str(tiny_model_dir), timeout=60)
    assert run.returncode == 2 and "needs --fleet" in run.stderr
    assert "Traceback" not in run.stderr


def test_the_engine_demo_on_the_tiny_model_reports_ttft_and_itl_per_class(tiny_model_dir):
    run = demo("--model", str(tiny_model_dir), "--chats", "4", "--rate", "20", "--documents", "1",
               "--doc-tokens", "256", "--no-compare")
    assert run.returncode == 0, run.stdout + run.stderr     # no chat missed a decode iteration
    assert set(rows(run.stdout, ENGINE_ROW)) == {"interactive", "document"}, run.stdout


def test_the_fleet_demo_on_smollm2_prints_real_answers(smollm2_dir):
    """A few chats and one short document: the first chat asks for the capital of France."""
    run = demo("--fleet", "--model", str(smollm2_dir), "--chats", "3", "--rate", "4",
               "--documents", "1", "--doc-tokens", "200")
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    questions = [i for i, line in enumerate(lines) if line.startswith("Q: ")]
    assert len(questions) == 4, run.stdout                   # 3 chats, 1 document
    answers = [lines[i + 1] for i in questions]
    assert all(a.startswith("A: ") and len(a) > 5 for a in answers), run.stdout
    assert lines[questions[0]] == "Q: What is the capital of France?"
    assert "Paris" in answers[0], run.stdout
    assert rows(run.stdout, FLEET_ROW) == {"interactive": ("3", "0"), "document": ("1", "0")}
