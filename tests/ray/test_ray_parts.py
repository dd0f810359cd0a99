"""The parts of `kvfleet up --ray` that decide without a cluster: which workers share a placement
group (a prefill/decode slice) and how, how many GPUs a worker actor asks for, what of kvfleet up's
environment reaches an actor's service, where a service listens (loopback unless the operator
opted in, then its node's address), which clusters a fleet refuses, and the fixed ports a
restarted actor comes back on."""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.cli import fleet_orders as fo
from services.cli import ports, ray_fleet, ray_host
from services.cli.up import add_up_args, port_plan
from services.protocol import bind

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


# --- where services listen, and the clusters a fleet refuses ---------------------------------

ips = st.lists(st.sampled_from(["127.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.1.7"]), min_size=1,
               max_size=5)


@given(ips, st.booleans(), st.booleans(), st.booleans())
def test_a_cluster_beyond_kvfleet_ups_address_needs_the_opt_in_a_shared_redis_and_networks(
        node_ips, external, redis, networks):
    nodes = {f"node-{k}": ip for k, ip in enumerate(node_ips)}
    why = ray_fleet.check_nodes(nodes, "node-0", external,
                                "redis://10.0.0.1:6379" if redis else None,
                                "10.0.0.0/16" if networks else None)
    if set(node_ips) == {node_ips[0]}:              # one address: one host, or a local cluster
        assert why is None
    elif not (external and redis and networks):
        assert why is not None and "a fleet across hosts needs" in why
        assert (bind.FLAG in why) == (not external)
    elif {"127.0.0.1"} & set(node_ips):                 # loopback is outside 10.0.0.0/16
        assert why is not None and "does not take the Ray nodes at" in why
    else:
        assert why is None


def test_without_the_opt_in_a_service_keeps_its_arguments_so_it_listens_on_127_0_0_1():
    """The actor changes a service's --host only with bind_node (the opt-in); then the last --host
    is the node's, with the flag the service asks for, and UCX uses that address's interface."""
    args = ["services.cli.cli", "serve", "decode", "--worker-id", "decode-0"]
    moved, env = ray_host.on_node(args, {"A": "1"}, "127.0.0.1")
    assert moved == [*args, "--host", "127.0.0.1", bind.FLAG]
    assert env == {"A": "1", "UCX_NET_DEVICES": "lo"}
    _, env = ray_host.on_node(args, {"UCX_NET_DEVICES": "mlx5_0:1"}, "127.0.0.1")
    assert env["UCX_NET_DEVICES"] == "mlx5_0:1"              # the operator's choice stays
    _, env = ray_host.on_node(args, {}, "203.0.113.7")        # an address no interface holds
    assert "UCX_NET_DEVICES" not in env


@pytest.mark.parametrize("flags", [[bind.FLAG], ["--ray-slice", "spread"]])
def test_the_ray_flags_without_ray_are_refused(flags):
    with pytest.raises(SystemExit, match="is for a Ray fleet"):
        ray_fleet.check_args(up_args(*flags))
    ray_fleet.check_args(up_args("--ray", *flags))


def test_kvfleet_up_refuses_the_opt_in_without_ray_before_it_starts_anything():
    out = subprocess.run([sys.executable, "-m", "services.cli.cli", "up", bind.FLAG],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"kvfleet up: {bind.FLAG} is for a Ray fleet (--ray); a fleet of local processes listens "
        "on 127.0.0.1 (the gateway on --host)")


def test_a_slice_is_packed_on_one_node_by_default_and_spread_over_two_on_request():
    assert ray_fleet.slice_strategy(up_args("--ray").ray_slice) == "STRICT_PACK"
    assert ray_fleet.slice_strategy(up_args("--ray", "--ray-slice", "spread").ray_slice) == \
        "STRICT_SPREAD"


@given(gpus=st.lists(st.integers(0, 8), min_size=1, max_size=6), asked=st.integers(0, 4),
       slices=st.integers(1, 12))
def test_packed_slices_are_aimed_at_the_nodes_that_can_hold_them_in_turn(gpus, asked, slices):
    nodes = [{"NodeID": f"n{k}", "Resources": {"CPU": 4.0, **({"GPU": float(g)} if g else {})}}
             for k, g in enumerate(gpus)]
    bundle = {"CPU": ray_fleet.ACTOR_CPUS, **({"GPU": asked} if asked else {})}
    aimed = [ray_fleet.target_node(nodes, bundle, turn) for turn in range(slices)]
    able = [n["NodeID"] for n, g in zip(nodes, gpus) if g >= asked]
    if not able:
        assert aimed == [None] * slices                 # Ray then says it cannot place them
        return
    assert set(aimed) <= set(able)
    counts = [aimed.count(n) for n in able]
    assert max(counts) - min(counts) <= 1               # spread: no node two slices ahead


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
