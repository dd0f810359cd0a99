"""`kvfleet up --ray ADDRESS --allow-external-bind --ray-slice spread` on a Ray cluster of two
nodes (two raylets, `ray.cluster_utils.Cluster`), every node on 127.0.0.1 as Ray's test clusters
are: the fleet's prefill and decode workers sit on different nodes (each descends from its own
node's raylet) and every router and worker listens on the address Ray knows its node by; the
KV crosses between the nodes over tcp and the client gets the in-process engine's greedy text; a
decode worker killed on its node is restarted by Ray on that node, on its port, and serves
again; nothing of the fleet or of the cluster listens beyond loopback (`ss -ltnp`); SIGTERM
stops every service and leaves the cluster, which the fleet only joined, running. One cluster
and one fleet for the module: two raylets and two model loads are its cost. Asked of the
cluster directly, packed slices (the default) each take one node and spread over the nodes."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from services.cli.launcher import descendants, running
from services.cli.ray_fleet import NODE_PREFIX
from services.protocol import env
from tests.faults.fault_fleet import LEASE_3S
from tests.harness import holds_nothing, serves, up_fleet
from tests.ray.greedy import assert_engines_greedy_text
from tests.waiting import wait_until

# Before Ray is first imported here: Ray reads it at import, and without it a driver in this
# process (the Cluster's) resolves 127.0.0.1 to the machine's external address
os.environ[env.RAY_LOOPBACK.name] = "0"
ray = pytest.importorskip("ray")
pytestmark = pytest.mark.real_model("the client's text equals the in-process engine's greedy text")

TOKEN = "ray-multinode-token-0123456789abcdef"
PROMPT = "Two Ray nodes share one fleet and its prompt"
DEADLINE_S = 120
LOOPBACK = ("127.0.0.1:", "[::1]:", "[::ffff:127.0.0.1]:")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head node and one more, each its own raylet, all on 127.0.0.1 (Ray's files in a short
    temp folder: its socket paths must fit AF_UNIX's limit)."""
    from ray.cluster_utils import Cluster  # noqa: PLC0415
    temp = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
    node = dict(num_cpus=1, node_ip_address="127.0.0.1")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp_path_factory.mktemp("ray-home")))   # Ray's token, not the user's
        # The Cluster writes its address to $RAY_TMPDIR/ray/ray_current_cluster, by default
        # /tmp/ray, which a fresh machine has not got: keep that file in the temp folder too.
        os.makedirs(os.path.join(temp, "ray"))
        mp.setenv("RAY_TMPDIR", temp)
        c = Cluster(initialize_head=True, shutdown_at_exit=False,
                    head_node_args=dict(node, include_dashboard=False, temp_dir=temp))
        try:
            c.add_node(**node)
            c.wait_for_nodes()
            yield c
        finally:
            c.shutdown()
            c.global_state.disconnect()   # its GCS client's threads would keep pytest from exiting
            shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet(cluster, tiny_model_dir):
    with up_fleet(tiny_model_dir, "--ray", cluster.address, "--allow-external-bind",
                  "--ray-slice", "spread", *LEASE_3S, mode="disagg", engine="real",
                  token=TOKEN, env={"HOME": os.environ["HOME"]}) as up:
        yield up


def raylets(cluster) -> dict[str, int]:
    """Each node's ID -> its raylet's pid."""
    return {n.node_id: n.all_processes["raylet"][0].process.pid for n in cluster.list_all_nodes()}


def cluster_pids(cluster) -> set[int]:
    """Every process of the cluster: each node's own (GCS, raylet, ...) and what they started."""
    own = {info.process.pid for n in cluster.list_all_nodes()
           for infos in n.all_processes.values() for info in infos}
    return own | {child for pid in own for child in descendants(pid)}


def placed(fleet) -> dict[str, str]:
    """Each service's node ID, from the banner's `ray-node` lines."""
    return {parts[1]: parts[2] for parts in (line.split() for line in fleet.lines)
            if len(parts) == 4 and parts[0] == NODE_PREFIX}


def listening() -> list[tuple[str, int]]:
    """(local address, pid) of every TCP listener `ss -ltnp` shows."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [(row.split()[3], int(pid)) for row in out.splitlines()
            for pid in re.findall(r"pid=(\d+)", row)]


def pid_on(address: str) -> int | None:
    """The process listening at `address` (host:port; gRPC's IPv4 listener shows as
    [::ffff:host]:port), if one is."""
    mapped = "[::ffff:{}]:{}".format(*address.rsplit(":", 1))
    return next((pid for at, pid in listening() if at in (address, mapped)), None)


def raylet_of(pid: int, cluster) -> str | None:
    """The node whose raylet `pid` descends from."""
    return next((node for node, raylet in raylets(cluster).items()
                 if pid in descendants(raylet)), None)


def test_prefill_and_decode_sit_on_two_nodes_each_listening_on_its_nodes_address(fleet, cluster):
    nodes = placed(fleet)
    assert {"gateway", "router-0", "prefill-0", "decode-0"} <= set(nodes)
    assert nodes["prefill-0"] != nodes["decode-0"]                 # STRICT_SPREAD: two nodes
    assert set(nodes.values()) <= set(raylets(cluster))
    for name in ("prefill-0", "decode-0"):
        address = fleet.workers[name].address
        assert address.startswith("127.0.0.1:")                  # the address Ray knows its node by
        assert raylet_of(pid_on(address), cluster) == nodes[name], name
    [ray_line] = [line for line in fleet.lines if line.strip().startswith("ray ")]
    assert "joined" in ray_line and "STRICT_SPREAD" in ray_line and "node addresses" in ray_line


def test_the_kv_crosses_the_nodes_and_the_client_gets_the_engines_greedy_text(fleet,
                                                                             tiny_model_dir):
    assert serves(fleet, 60), "\n".join(fleet.lines[-30:])
    assert_engines_greedy_text(fleet.url, fleet.model, str(tiny_model_dir), PROMPT)
    kv = dict(((s, k), a) for s, k, a in fleet.listeners)[("decode-0", "kv")]
    assert kv.startswith("127.0.0.1:")                 # the receiver the prefill node wrote to
    assert wait_until(lambda: holds_nothing(fleet), 30)


def test_a_decode_worker_killed_on_its_node_is_restarted_there_by_ray(fleet, cluster):
    address, node = fleet.workers["decode-0"].address, placed(fleet)["decode-0"]
    old = pid_on(address)
    os.kill(old, signal.SIGKILL)
    assert wait_until(lambda: pid_on(address) not in (None, old), DEADLINE_S), \
        "\n".join(fleet.lines[-20:])
    assert raylet_of(pid_on(address), cluster) == node           # the same node, the same port
    assert wait_until(lambda: any("decode-0 was restarted by Ray" in line
                                  for line in fleet.lines), DEADLINE_S)
    assert serves(fleet, DEADLINE_S), "\n".join(fleet.lines[-30:])
    assert wait_until(lambda: holds_nothing(fleet), 30)


def test_nothing_of_the_fleet_or_the_cluster_listens_beyond_loopback(fleet, cluster):
    ours = set(fleet.tree()) | cluster_pids(cluster)
    found = [(address, pid) for address, pid in listening() if pid in ours]
    assert len(found) >= len(fleet.listeners)
    off = [(address, pid) for address, pid in found if not address.startswith(LOOPBACK)]
    assert not off, off


def test_sigterm_stops_every_service_and_leaves_the_joined_cluster_running(fleet, cluster):
    services = {pid_on(a) for _, _, a in fleet.listeners} - {None}
    fleet.proc.send_signal(signal.SIGTERM)
    assert fleet.proc.wait(timeout=60) == 0
    assert wait_until(lambda: not any(map(running, services)), 30), \
        [p for p in services if running(p)]
    assert all(running(pid) for pid in raylets(cluster).values())


PLACE = """
import json, sys
from services.cli.ray_fleet import RayCluster, RayLauncher
launcher = RayLauncher(RayCluster.connect(sys.argv[1]))     # sets Ray's loopback setting first
try:
    launcher.place(["prefill-0", "decode-0", "prefill-1", "decode-1"])
    from ray.util import placement_group_table
    print(json.dumps({name: placement_group_table(pg)["bundles_to_node_id"][k]
                      for name, (pg, k) in launcher._groups.items()}))
finally:
    launcher.stop_all()
    __import__("ray").shutdown()
"""


def test_packed_slices_each_take_one_node_and_spread_over_the_nodes(cluster):
    """`--ray-slice pack` (the default), asked of the cluster by a driver process of its own:
    prefill-i with decode-i on one node (STRICT_PACK), slice 0 and slice 1 on different nodes."""
    out = subprocess.run([sys.executable, "-c", PLACE, cluster.address], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    node = json.loads(out.stdout.strip().splitlines()[-1])
    assert node["prefill-0"] == node["decode-0"] and node["prefill-1"] == node["decode-1"]
    assert node["prefill-0"] != node["prefill-1"]
    assert {node["prefill-0"], node["prefill-1"]} == set(raylets(cluster))
