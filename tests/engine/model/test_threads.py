"""The engine's torch thread count (services/engine/model/threads.py): vLLM's CPU rule, one thread
per physical core less one reserved for the front end, set when a CPU model loads."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model.threads import auto_threads, engine_threads, physical_cores


@given(st.integers(min_value=1, max_value=512))
def test_all_cores_but_one_and_never_none(cores):
    n = auto_threads(cores)
    assert 1 <= n <= cores
    assert n == (cores - 1 if cores >= 2 else 1)


def test_on_two_cores_one_thread_as_vllm_binds():
    assert auto_threads(2) == 1


def write_topology(sysfs, cpu: int, package: int, core: int) -> None:
    topology = sysfs / f"cpu{cpu}" / "topology"
    topology.mkdir(parents=True)
    (topology / "physical_package_id").write_text(f"{package}\n")
    (topology / "core_id").write_text(f"{core}\n")


def test_smt_siblings_count_as_one_core(tmp_path):
    # two sockets of two cores with two hardware threads each: 8 logical CPUs, 4 cores
    for cpu in range(8):
        write_topology(tmp_path, cpu, package=cpu // 4, core=cpu % 2)
    assert physical_cores(range(8), tmp_path) == 4
    assert physical_cores([0, 2], tmp_path) == 1      # one core's two siblings


def test_a_cpu_without_topology_counts_as_its_own_core(tmp_path):
    assert physical_cores([0, 1, 5], tmp_path) == 3


def test_a_configured_count_is_taken_as_given_and_a_negative_one_refused():
    assert engine_threads(3) == 3
    with pytest.raises(ValueError, match="torch_threads"):
        engine_threads(-1)
    with pytest.raises(ValueError, match="torch_threads"):
        EngineConfig(torch_threads=-1)


@pytest.fixture
def torch_threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_cpu_engine_runs_its_configs_thread_count(tiny_model_dir, torch_threads_restored):
    torch.set_num_threads(2)
    LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", torch_threads=1)).close()
    assert torch.get_num_threads() == 1
    LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu")).close()
    assert torch.get_num_threads() == engine_threads(0)
