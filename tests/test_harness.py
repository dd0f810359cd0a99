"""The harness every fleet test starts kvfleet with (tests/harness.py, loadtests/local_fleet.py):
`kvfleet up` as a real subprocess, its banner read into a typed UpFleet, and on exit nothing of
it left: no process of its tree, no port it listened on."""
from __future__ import annotations

import socket
from dataclasses import replace

import httpx
import pytest

from loadtests.local_fleet import up_command
from services.cli.launcher import Launcher, running
from services.engine.config import SchedulerConfig
from services.engine.config_file import load_engine_config
from tests.harness import (ENGINE, TEST_TTFT_TARGET_S, Fleet, _engine_args, fleet_targets_config,
                           holds_nothing, serves, sim_args, targets_args, up_fleet)


def port_open(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, int(port))) == 0


def test_a_disaggregated_fleet_is_typed_from_its_banner_serves_and_leaves_nothing(tiny_model_dir):
    with up_fleet(tiny_model_dir, mode="disagg", routers=2, token="harness-token-0123456789") \
            as up:
        assert sorted(up.routers) == ["router-0", "router-1"]
        assert {name: w.role for name, w in up.workers.items()} == {"prefill-0": "prefill",
                                                                     "decode-0": "decode"}
        for service in (*up.routers.values(), *up.workers.values()):
            assert service.pid == up.pid(service.name) and running(service.pid), service
            assert port_open(service.address), service
            assert httpx.get(service.metrics_url, timeout=10).status_code == 200, service
        assert up.redis_url.startswith("redis://") and port_open(up.grpc)
        assert up.model and serves(up, 60) and holds_nothing(up)    # the token reaches Stats
        tree = up.tree()
        listening = [address for _, _, address in up.listeners]
        assert len(tree) >= 6 and all(map(port_open, listening)), (tree, listening)
    assert up.proc.returncode is not None
    assert not [pid for pid in tree if running(pid)]
    assert not [address for address in listening if port_open(address)]


def test_a_fleet_that_cannot_start_is_an_error_naming_its_output_and_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="exited before READY"):
        with up_fleet(tmp_path / "no-such-model", mode="colocated", ready_s=120):
            pass


def test_the_engine_flag_is_passed_only_when_asked():
    real = up_command("tiny", mode="colocated")
    assert "--engine" not in real and real[real.index("--mode") + 1] == "colocated"
    sim = up_command("tiny", "--routers", "2", engine="sim", sim_args=("--sim-kv-tokens", "4096"))
    assert sim[sim.index("--engine"):][:4] == ["--engine", "sim", "--sim-kv-tokens", "4096"]
    with pytest.raises(ValueError, match="need engine='sim'"):
        up_command("tiny", sim_args=("--sim-kv-tokens", "4096"))


def test_a_simulated_worker_gets_the_kv_capacity_its_kv_cache_mib_gives_the_tiny_model():
    assert ENGINE == "sim"              # the tests' default; real_model tests pass engine="real"
    assert _engine_args("real", ("--kv-cache-mib", "64"), 32) == ("--kv-cache-mib", "64")
    args = _engine_args(None, ("--kv-cache-mib", "16", "--config", "x.yaml"), 64)
    assert args[:2] == ("--engine", "sim") and args[-4:] == ("--kv-cache-mib", "16", "--config",
                                                             "x.yaml")
    assert args[2:-4] == sim_args(16)
    tokens = sim_args(16)[sim_args(16).index("--sim-kv-tokens") + 1]
    assert int(tokens) == 16 * 1024 * 1024 // (4 * 2 * 2 * 32 * 4)   # the tiny model's fp32 KV
    assert _engine_args("sim", ("--engine", "sim", "--sim-kv-tokens", "9"), 64) == \
        ("--engine", "sim", "--sim-kv-tokens", "9")                  # the test's own flags


def test_test_fleets_run_the_production_classes_with_test_sized_ttft_targets():
    production = SchedulerConfig()
    for role in ("prefill", "decode", "mixed"):
        loaded = load_engine_config(fleet_targets_config(), role).scheduler
        # every class as in production but its TTFT target, raised to the test fleets' least
        assert [replace(c, ttft_target_s=p.ttft_target_s)
                for c, p in zip(loaded.classes, production.classes)] == list(production.classes)
        assert [c.ttft_target_s for c in loaded.classes] == [
            max(p.ttft_target_s, TEST_TTFT_TARGET_S) for p in production.classes]
        assert loaded.tenants == production.tenants and loaded.role == role


def test_a_fleet_process_gets_the_test_targets_unless_it_has_a_config_or_asks_for_production(
        tmp_path):
    fleet = Fleet(Launcher(log_dir=str(tmp_path)), "redis://127.0.0.1:1/1")
    assert fleet._with_targets(("--kv-cache-mib", "4")) == (
        "--kv-cache-mib", "4", "--config", fleet_targets_config())
    assert fleet._with_targets(("--config", "own.yaml")) == ("--config", "own.yaml")
    production = Fleet(Launcher(log_dir=str(tmp_path)), "redis://127.0.0.1:1/1",
                       targets="production")
    assert production._with_targets(("--kv-cache-mib", "4")) == ("--kv-cache-mib", "4")
    assert targets_args("production") == ()
    with pytest.raises(ValueError, match="targets must be one of"):
        targets_args("relaxed")
