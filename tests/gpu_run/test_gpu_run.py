"""The prepared GPU run (kernels/gpu_run.py) on the CPU: the same script, --device cpu --small, so
everything but CUDA itself is proven where no GPU is at hand. One run per module: it serves the
tiny model in-process and through `kvfleet up --device cpu` twice (disaggregated, co-located),
then the story reads its result.json."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.waiting import wait_until

pytestmark = pytest.mark.real_model("the claim is that the device engine's and the fleets' greedy "
                                    "tokens equal the CPU engine's")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-run")
    run = subprocess.run([sys.executable, "-m", "kernels.gpu_run", "--device", "cpu", "--small",
                          "--out", str(out), "--budget-s", "600"],
                         capture_output=True, text=True, timeout=700,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert (out / "result.json").is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    return run.returncode, json.loads((out / "result.json").read_text()), out


def test_the_cpu_run_passes_and_says_what_it_skipped(result):
    rc, doc, _ = result
    assert rc == 0 and doc["ok"], json.dumps(doc["steps"], indent=1)
    assert doc["device"] == "cpu" and doc["env"]["cuda"] is False
    assert doc["kernels"] is None
    assert {"step": "kernels", "skipped": "needs CUDA (tests/kernels runs under the interpreter in CI)"} \
        in doc["steps"]
    assert [s["step"] for s in doc["steps"] if "rc" in s] == ["serve:tiny"]


def test_the_engine_and_both_fleets_give_the_cpu_engines_greedy_tokens(result):
    _, doc, _ = result
    tiny = doc["models"]["tiny"]
    assert tiny["engine"]["device"] == "cpu"
    assert tiny["engine"]["greedy"]["equal"] and tiny["engine"]["greedy"]["compared"] > 0
    assert set(tiny["fleets"]) == {"disagg", "colocated"}
    for mode, fleet in tiny["fleets"].items():
        assert fleet["greedy"]["equal"], (mode, fleet)
        assert fleet["greedy"]["compared_tokens"] > 0


def test_each_fleet_reports_the_bursts_rates_beside_the_engines(result):
    _, doc, _ = result
    tiny = doc["models"]["tiny"]
    assert tiny["engine"]["burst"]["output_tokens_per_s"] > 0
    for fleet in tiny["fleets"].values():
        burst = fleet["burst"]
        assert burst["served"] == tiny["sizes"]["chats"] and burst["refused"] == 0, burst
        assert burst["output_tokens_per_s"] > 0
        assert burst["classes"]["chat"]["ttft_p50_s"] > 0 and burst["itl_p50_s"] > 0
        assert fleet["tok_s_over_engine"] > 0


def test_the_wheels_it_needs_are_listed_with_how_to_fetch_them():
    listed = subprocess.run([sys.executable, "-m", "kernels.gpu_run", "--list-wheels"],
                            capture_output=True, text=True, timeout=120, check=True)
    doc = json.loads(listed.stdout)
    assert {"grpcio", "msgspec", "pyzmq", "openai"} <= set(doc["distributions"])
    assert doc["missing_here"] == []            # this venv has the fleet
    assert doc["fetch"].startswith("pip download ") and "torch" not in doc["fetch"].split()


def test_a_step_past_its_limit_is_stopped_with_everything_it_started(tmp_path):
    from kernels.gpu_run import Run
    run = Run(tmp_path, budget_s=60)
    pidfile = tmp_path / "grandchild.pid"
    assert not run.step("slow", 1.0, ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"],
                        min_s=0.5)
    assert run.steps[-1]["rc"] == "timeout"
    grandchild = int(pidfile.read_text())
    assert wait_until(lambda: not running(grandchild), timeout_s=10)


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits for whoever reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_step_that_does_not_fit_the_budget_is_skipped_not_started(tmp_path):
    from kernels.gpu_run import Run
    run = Run(tmp_path, budget_s=3)
    assert not run.step("late", 100, ["sh", "-c", f"touch {tmp_path / 'ran'}"], min_s=5)
    assert run.steps == [{"step": "late", "skipped": "3 s left of the budget"}]
    assert not (tmp_path / "ran").exists()


def test_the_engine_decodes_with_cuda_graphs_off_and_on_to_the_same_greedy_tokens(result):
    """On the CPU `on` is the padded steps run eagerly (the graphs themselves need CUDA); the run
    records decode tok/s at batch 1 and at the burst's size for both, and the tokens agree."""
    _, doc, _ = result
    tiny = doc["models"]["tiny"]
    graphs = tiny["cuda_graphs"]
    assert graphs["greedy"]["equal"] and graphs["greedy"]["compared"] > 0, graphs
    assert graphs["padded_steps_on"] > 0
    for side in ("off", "on"):
        assert [d["batch"] for d in graphs[side]] == [1, tiny["sizes"]["chats"]]
        assert all(d["tokens_per_s"] > 0 for d in graphs[side])
    assert all(d["speedup_over_off"] > 0 for d in graphs["on"])


def test_a_serve_step_stopped_early_keeps_the_phases_it_finished(tmp_path):
    """gpu_serve saves its file after each phase; the run's verdict reads whatever is there."""
    from kernels.gpu_run import Run, finish
    from kernels.gpu_serve import save
    partial = {"engine": {"greedy": {"equal": True}}}
    save(str(tmp_path / "serve.json"), partial)
    assert json.loads((tmp_path / "serve.json").read_text()) == partial
    assert not (tmp_path / "serve.json.part").exists()
    run = Run(tmp_path, budget_s=60)
    run.steps.append({"step": "serve:tiny", "rc": "timeout"})
    doc = finish({"models": {"tiny": partial}}, run)
    assert doc["greedy_equal"] is False and doc["ok"] is False    # no cuda_graphs phase: not proven
