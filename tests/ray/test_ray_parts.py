"""The parts of `kvfleet up --ray` that decide without a cluster: which workers share a placement
group (a prefill/decode slice), how many GPUs a worker actor asks for, what of kvfleet up's
environment reaches an actor's service, and the fixed ports a restarted actor comes back on."""
from __future__ import annotations

import argparse
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.cli import fleet_orders as fo
from services.cli import ports, ray_fleet
from services.cli.up import add_up_args, port_plan

names = st.lists(st.tuples(st.sampled_from(["prefill", "decode", "mixed", "router", "gateway"]),
                           st.integers(0, 9)), unique=True, max_size=20).map(
    lambda pairs: [f"{role}-{i}" if role != "gateway" else "gateway" for role, i in pairs])


@given(names)
def test_every_worker_is_in_one_group_and_a_slice_is_prefill_i_with_decode_i(fleet):
    groups = ray_fleet.slices(fleet)
    placed = [n for g in groups for n in g]
    workers = [n for n in fleet if n.partition("-")[0] in ray_fleet.WORKER_ROLES]
    assert sorted(placed) == sorted(set(workers))           # each worker once, nothing else
    for group in groups:
        roles = sorted(n.partition("-")[0] for n in group)
        indexes = {n.partition("-")[2] for n in group}
        assert roles in (["mixed"], ["prefill"], ["decode"], ["decode", "prefill"])
        assert len(indexes) == 1                             # one slice: one index


def test_a_disaggregated_fleet_has_a_slice_per_index():
    assert ray_fleet.slices(["prefill-0", "prefill-1", "decode-0", "router-0", "gateway"]) == [
        ["prefill-0", "decode-0"], ["prefill-1"]]


@given(gpus=st.floats(0, 64), tp=st.integers(1, 8),
       device=st.sampled_from([None, "auto", "cpu", "cuda"]))
def test_gpus_are_asked_for_only_where_the_cluster_has_them(gpus, tp, device):
    asked = ray_fleet.gpus_per_worker(gpus, device, tp)
    assert asked == (0 if gpus <= 0 or device == "cpu" else tp)


def test_the_actors_own_gpu_assignment_is_not_overwritten_by_kvfleet_ups():
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "RAY_ADDRESS": "x", "KVFLEET_FLEET_TOKEN": "t",
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    assert ray_fleet.passed_env(env) == {"KVFLEET_FLEET_TOKEN": "t",
                                        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}


def up_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_up_args(p)
    return p.parse_args(argv)


def test_without_port_base_a_free_base_is_found_and_the_gateways_zero_ports_take_the_table():
    args = up_args("--ray", "--http-port", "0", "--grpc-port", "0", "--prefill", "2")
    assert args.ray == ray_fleet.LOCAL
    plan_of = lambda base: port_plan(argparse.Namespace(**{**vars(args), "port_base": base}), True)  # noqa: E731
    ray_fleet.pin_ports(args, plan_of)
    assert args.port_base is not None and (args.http_port, args.grpc_port) == (None, None)
    plan = port_plan(args, True)
    assert ports.taken(plan) is None
    assert {(x.service, x.kind) for x in plan} >= {("gateway", "http"), ("prefill-1", "kv"),
                                                   ("decode-0", "grpc"), ("redis", "redis")}


def test_a_given_port_base_and_gateway_ports_are_kept():
    args = up_args("--ray", "10.0.0.5:6379", "--port-base", "31000", "--http-port", "8080")
    ray_fleet.pin_ports(args, lambda base: [])
    assert (args.ray, args.port_base, args.http_port) == ("10.0.0.5:6379", 31000, 8080)


def test_no_free_base_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(ray_fleet, "PORT_BASE_FROM", 40000)
    monkeypatch.setattr(ray_fleet, "PORT_BASE_TO", 40001)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 40000))
        held.listen()
        with pytest.raises(SystemExit, match="no free --port-base"):
            ray_fleet.pin_ports(up_args("--ray"),
                                lambda base: [ports.Listener("gateway", "http", base)])


# --- a worker `kvfleet rebalance --target ray` adds takes its own ports of the table ----------

@given(base=st.integers(1024, 65535 - ports.SPAN), role=st.sampled_from(["prefill", "decode"]),
       index=st.integers(1, 9), backend=st.sampled_from(["tcp", "nixl"]))
def test_an_added_worker_gets_the_ports_a_fleet_started_with_it_would_have(base, role, index,
                                                                          backend):
    name = f"{role}-{index}"
    started = up_args("--ray", "--port-base", str(base), "--kv-backend", backend,
                      "--prefill", "1", "--decode", "1")
    template = [a for x in port_plan(started, True) if x.service == f"{role}-0"
                for a in (ports.CHILD_FLAGS.get(x.kind, ""), str(x.port))]
    bigger = up_args("--ray", "--port-base", str(base), "--kv-backend", backend,
                     f"--{role}", str(index + 1))
    plan, why = fo.table_ports(base, template, name)
    assert why == "" and plan == [x for x in port_plan(bigger, True) if x.service == name]


def test_past_the_tables_room_or_without_a_table_an_added_worker_takes_free_ports():
    assert fo.table_ports(None, [], "decode-1") == ([], "the fleet has no --port-base table")
    plan, why = fo.table_ports(31000, [], "decode-10")
    assert plan == [] and "room for 10" in why


class StandInLauncher:
    """A named stand-in for kvfleet up's launcher (Ray's or the process one): it records what it
    is asked to spawn; the actor Ray restarts reruns exactly those arguments."""

    kind = "ray"

    def __init__(self, children: dict[str, list[str]]) -> None:
        self.children = {n: argparse.Namespace(module_args=a, address=None)
                         for n, a in children.items()}
        self.spawned: dict[str, list[str]] = {}

    def spawn(self, name: str, module_args: list[str]) -> None:
        self.spawned[name] = module_args
        self.children[name] = argparse.Namespace(module_args=module_args, address=None)


def desk_of(base: int | None, said: list[str]) -> tuple[fo.OrderDesk, StandInLauncher]:
    args = up_args("--ray", "--port-base", str(base or 31000), "--prefill", "1", "--decode", "1")
    plan = port_plan(args, True) if base else []
    launcher = StandInLauncher({"decode-0": ["services.cli.cli", "serve", "decode", "--worker-id",
                                             "decode-0", *ports.child_args(plan, "decode-0")]})
    supervisor = argparse.Namespace(retired=set(), retiring=set(), pinned={})
    return fo.OrderDesk(launcher, supervisor, redis=None, seal=None, say=said.append,
                        announce=lambda line: None, port_base=base), launcher


def test_the_added_worker_is_started_on_its_table_ports_so_a_restart_comes_back_on_them():
    said: list[str] = []
    desk, launcher = desk_of(45200, said)
    result = desk.carry_out(fo.FleetOrder(fo.Action.ADD, "decode", "o1"))
    assert result.accepted and result.worker_id == "decode-1"
    argv = launcher.spawned["decode-1"]
    value = lambda flag: argv[argv.index(flag) + 1]  # noqa: E731
    assert [value(f) for f in ("--port", "--metrics-port", "--kv-port")] == ["45261", "45271",
                                                                            "45281"]
    assert value("--worker-id") == "decode-1" and said == []
    assert not desk._pending                  # nothing to learn once it serves: its port is fixed


def test_a_taken_table_port_or_no_table_means_free_ports_said_so():
    said: list[str] = []
    desk, launcher = desk_of(45300, said)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 45361))       # decode-1's gRPC port on that table
        held.listen()
        desk.carry_out(fo.FleetOrder(fo.Action.ADD, "decode", "o2"))
    assert "--port" not in launcher.spawned["decode-1"]
    assert said == ["kvfleet up: decode-1 takes free ports: its table port 45361 (grpc) is in use"]
    desk, launcher = desk_of(None, said := [])
    desk.carry_out(fo.FleetOrder(fo.Action.ADD, "decode", "o3"))
    assert "--port" not in launcher.spawned["decode-1"] and said == []
