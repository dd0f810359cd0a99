"""`kvfleet up --ray [ADDRESS]`: the same services, each hosted by a Ray actor.

Every service `kvfleet up` starts as a child process (gateway, routers, workers) is started here by
a `ServiceHost` actor (services/cli/ray_host.py) instead: the actor is a process of its own on a
Ray node, and it runs the very command `kvfleet up` would (`python -m services.cli.lifeline <module> <args...>`, through a
`Launcher` of its own), so the service, its flags, its READY line, its ports and its health checks
are the ones of the plain fleet. What Ray adds:

  placement   workers ask for GPUs (`num_gpus`: their tensor-parallel ranks) only when the cluster
              has GPUs and `--device` is not cpu; prefill-i and decode-i of a disaggregated fleet
              are one slice, one placement group. `--ray-slice pack` (the default): STRICT_PACK,
              the slice on one node (its KV moves over that node's NVLink), each slice aimed at
              the next node in turn so that replicas spread; `--ray-slice spread`: STRICT_SPREAD,
              prefill and decode of a slice on two nodes (workers too big to share one; the KV
              crosses the network). Routers spread over the nodes (SPREAD); the gateway stays on
              kvfleet up's node (its --host is an address of that node)
  nodes       without `--allow-external-bind` every service listens on 127.0.0.1, so a cluster
              whose nodes have other addresses than kvfleet up's is refused. With it, routers and
              workers listen on their node's address (ray_host.py, `bind_node`) and advertise it;
              a cluster over several hosts also needs a --redis-url and --allowed-networks every
              node can use (the embedded Redis listens on kvfleet up's loopback)
  restarts    a service that exits makes its actor exit (status 1); Ray restarts the actor
              (`max_restarts`), whose new process starts the service again on the same ports
              (under --ray every listener is on the --port-base table: kvfleet up finds a free
              base when none is given). The actor says so on its log (Ray forwards it to
              `kvfleet up`'s stderr), and kvfleet up prints `<name> was restarted by Ray` when it
              sees a new service pid. An actor Ray gave up on is restarted by kvfleet up's
              supervisor, as a dead child (with its backoff)
  drain       SIGUSR1 (`kvfleet rebalance --apply --target ray`, services/cli/fleet_orders.py)
              is passed to the service and marks the actor draining: its service's exit is its
              end, and kvfleet up then kills the actor without restart
  stop        every actor stops its service (SIGTERM, SIGKILL past the grace), then is killed; a
              local cluster kvfleet up started is shut down with it

`RayLauncher` has the shape of `Launcher` (services/cli/launcher.py): `children` (each with
`proc.poll()`, `address`, `lines`), `start_many`, `spawn`, `kill`, `signal`, `stop_all`, so the
supervisor, the health watch, the order desk and the banner of `kvfleet up` work on it unchanged.

A local cluster (no ADDRESS) binds 127.0.0.1 only, with no dashboard, its files in a temp folder
of its own (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is set before Ray starts: without it Ray 2.60
advertises the host's external address). An ADDRESS joins a running cluster (`ray.init(address)`;
its token in $RAY_AUTH_TOKEN when the cluster asks for one).
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.cli import ports
from services.cli.launcher import LaunchError, STOP_GRACE_S
from services.cli.ray_host import RESTART_STATUS, ServiceHost, say
from services.protocol import bind, env, fleet_token
from services.state import records

LOCAL = "local"                 # `--ray` without an address: a local cluster on 127.0.0.1
NAMESPACE = "kvfleet"
ACTOR_CPUS = 0.01               # what an actor claims: its service's threads are its own business
MAX_RESTARTS = 20               # Ray's restarts of one actor before the supervisor's take over
GONE_AFTER = 3                  # refused calls in a row: Ray gave the actor up
WATCH_EVERY_S = 1.0             # how often kvfleet up asks each actor about its service
CALL_TIMEOUT_S = 5.0            # one call to an actor (a restarting one does not answer)
PLACEMENT_TIMEOUT_S = 60.0      # a placement group the cluster cannot place fails the start
# Ray's own per-process settings that must not travel from kvfleet up to another process
NOT_PASSED = ("CUDA_VISIBLE_DEVICES", "RAY_ADDRESS")
WORKER_ROLES = ("prefill", "decode", "mixed")
MAX_TEMP_ROOT = 20              # longer temp folders leave Ray's socket paths too long
# where a free base is sought: below Linux's ephemeral ports (32768 and up by default), which any
# process's outgoing connection or port-0 listener may take between the check and the bind
PORT_BASE_FROM, PORT_BASE_TO, PORT_BASE_STEP = 20000, 32768 - ports.SPAN, 100
NODE_PREFIX = "ray-node"        # the banner's `  ray-node  <service> <node ID> <node IP>` lines
# --ray-slice: the strategy of a slice's placement group
SLICE_STRATEGIES = {"pack": "STRICT_PACK", "spread": "STRICT_SPREAD"}


# ------------------------------------------------------------------ the cluster

@dataclass
class RayCluster:
    """The Ray cluster the fleet runs on: a local one kvfleet up started (`owned`), or one it
    joined at `address`."""
    address: str
    owned: bool
    temp_dir: str = ""
    gpus: float = 0.0
    node_id: str = ""               # kvfleet up's own node (the driver's)

    @classmethod
    def connect(cls, address: str) -> "RayCluster":
        env.RAY_LOOPBACK.set("0")
        import ray  # noqa: PLC0415 - heavy; only under --ray
        if ray.is_initialized():
            ray.shutdown()
        if address == LOCAL:
            temp_dir = tempfile.mkdtemp(prefix="kvfleet-ray-", dir=_short_temp_root())
            info = ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False,
                            _node_ip_address=ports.HOST, _temp_dir=temp_dir,
                            namespace=NAMESPACE, log_to_driver=True,
                            configure_logging=False)
            cluster = cls(info.address_info["gcs_address"], True, temp_dir)
        else:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
            cluster = cls(address, False)
        cluster.gpus = float(ray.cluster_resources().get("GPU", 0.0))
        cluster.node_id = ray.get_runtime_context().get_node_id()
        return cluster

    def nodes(self) -> list[dict]:
        """The cluster's live nodes, as ray.nodes() describes them, in NodeID order."""
        import ray  # noqa: PLC0415
        return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])

    def node_ips(self) -> dict[str, str]:
        """Each live node's ID -> the address Ray knows it by."""
        return {n["NodeID"]: n["NodeManagerAddress"] for n in self.nodes()}

    def shutdown(self) -> None:
        """Leave the cluster; a local one is stopped and its temp folder removed (the services'
        logs are kvfleet up's, in its log folder)."""
        import ray  # noqa: PLC0415
        ray.shutdown()
        if self.owned and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def _short_temp_root() -> str:
    """The temp folder, or /tmp when it is too long: Ray's socket paths under it must fit
    AF_UNIX's 107 bytes (its session folder and socket names take about 85)."""
    root = tempfile.gettempdir()
    return root if len(root) <= MAX_TEMP_ROOT else "/tmp"


def gpus_per_worker(cluster_gpus: float, device: str | None, tensor_parallel: int) -> int:
    """GPUs one worker actor asks for: one per tensor-parallel rank on a cluster with GPUs, none
    on one without (or with --device cpu)."""
    if cluster_gpus <= 0 or device == "cpu":
        return 0
    return max(1, tensor_parallel)


def slices(names: list[str]) -> list[list[str]]:
    """The placement groups of a fleet's workers: prefill-i with decode-i (a slice; one alone if
    its peer does not exist); every other worker in a group of its own."""
    groups: dict[str, list[str]] = {}
    for name in names:
        role, _, index = name.partition("-")
        if role not in WORKER_ROLES:
            continue
        key = f"slice-{index}" if role in ("prefill", "decode") else name
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def passed_env(env: dict[str, str]) -> dict[str, str]:
    """What of kvfleet up's child environment an actor's service gets (Ray's own per-process
    settings, such as the GPUs Ray gave the actor, stay the actor's)."""
    return {k: v for k, v in env.items() if k not in NOT_PASSED}


def check_nodes(node_ips: dict[str, str], own_node: str, external_bind: bool,
                redis_url: str | None, allowed_networks: str | None) -> str | None:
    """Why a fleet cannot run on a cluster of these nodes (None: it can). All on kvfleet up's
    address (one host, or a local cluster on 127.0.0.1): anything goes. Nodes elsewhere need the
    opt-in (services listen on their node's address), a Redis every node reaches (the embedded
    one is on kvfleet up's loopback) and allowed networks (--allowed-networks or
    $KVFLEET_ALLOWED_NETWORKS) that take the nodes' addresses (routers accept only worker records
    whose address is in them)."""
    own_ip = node_ips.get(own_node, "")
    others = sorted({ip for ip in node_ips.values() if ip != own_ip})
    if not others:
        return None
    missing = [what for what, given in ((bind.FLAG, external_bind), ("--redis-url", redis_url),
                                        ("--allowed-networks", allowed_networks)) if not given]
    if missing:
        return (f"the Ray cluster has nodes at {', '.join(others)} beside kvfleet up's {own_ip}: "
                f"a fleet across hosts needs {', '.join(missing)} (services then listen on their "
                "node's address; see docs/deploy.md, Ray)")
    networks = records.parse_networks(allowed_networks)
    outside = [ip for ip in [own_ip, *others]
               if records.address_problem(f"{ip}:0" if ":" not in ip else f"[{ip}]:0", networks)]
    if outside:
        return (f"--allowed-networks {allowed_networks} does not take the Ray nodes at "
                f"{', '.join(outside)}: their workers' records would be refused")
    return None


def target_node(nodes: list[dict], bundle: dict[str, float], turn: int) -> str | None:
    """The node a packed group is aimed at on its `turn`: the nodes whose resources could hold
    its `bundle`, each in turn (ray.nodes()' NodeID and Resources); None when none could."""
    fits = [n["NodeID"] for n in nodes
            if all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in bundle.items())]
    return fits[turn % len(fits)] if fits else None


def slice_strategy(name: str | None) -> str:
    """The placement strategy of a slice's group for `--ray-slice NAME` (default pack)."""
    return SLICE_STRATEGIES[name or "pack"]


# ------------------------------------------------------------------ kvfleet up's side

@dataclass
class ActorProc:
    """What the supervisor reads as a child's process: running while its actor lives (Ray restarts
    the service in it), an exit status once the actor is gone for good."""
    pid: int | None = None          # the service's process, as last seen
    status: int | None = None

    def poll(self) -> int | None:
        return self.status

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.status is None and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)
        return self.status


@dataclass
class RayChild:
    """A service of the fleet, hosted by `actor` (the shape of launcher.Child)."""
    name: str
    actor: object
    module_args: list[str]
    proc: ActorProc = field(default_factory=ActorProc)
    address: str = ""
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    restarts: int = 0               # service pids seen replaced by Ray's restarts
    refusals: int = 0               # calls its actor refused in a row
    node_id: str = ""               # the Ray node its actor runs on, once it answered
    node_ip: str = ""


class RayLauncher:
    """`Launcher`'s interface over ServiceHost actors (see the module docstring)."""

    def __init__(self, cluster: RayCluster, env: dict[str, str] | None = None,
                 log_dir: str | None = None, worker_gpus: int = 0,
                 say: Callable[[str], None] = say, external_bind: bool = False,
                 slices_as: str = "pack") -> None:
        """`external_bind`: routers and workers listen on their node's address (the operator's
        opt-in); `slices_as`: `--ray-slice` (pack | spread)."""
        self.cluster = cluster
        self.external_bind = external_bind
        self.slice_strategy = slice_strategy(slices_as)
        self._slices_placed = 0                         # pack: the next slice's node, in turn
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env = {**env, **fleet_token.child_env(env)}     # one token, as Launcher's
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvfleet-logs-")
        self.kind = "ray"
        self.children: dict[str, RayChild] = {}
        self.stopping = threading.Event()
        self.worker_gpus = worker_gpus
        self.say = say
        self._groups: dict[str, tuple[object, int]] = {}   # worker -> (placement group, bundle)
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    # -- starting
    def place(self, names: list[str]) -> None:
        """A placement group per slice of these workers (`slices`); waits until each is placed."""
        import ray  # noqa: PLC0415
        from ray.util.placement_group import placement_group  # noqa: PLC0415
        for group in slices(names):
            bundle = {"CPU": ACTOR_CPUS, **({"GPU": self.worker_gpus} if self.worker_gpus else {})}
            strategy = self.slice_strategy if len(group) > 1 else "STRICT_PACK"
            pg = placement_group([dict(bundle) for _ in group], strategy=strategy,
                                 name=f"kvfleet-{'+'.join(group)}",
                                 _soft_target_node_id=self._next_node(strategy, bundle))
            try:
                ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise LaunchError(f"Ray could not place {', '.join(group)} ({strategy}) within "
                                  f"{PLACEMENT_TIMEOUT_S:.0f}s (asked {bundle} each)") from None
            for k, name in enumerate(group):
                self._groups[name] = (pg, k)

    def _next_node(self, strategy: str, bundle: dict[str, float]) -> str | None:
        """A STRICT_PACK group's soft target: the nodes that could hold it, each in turn (Ray
        places it elsewhere when that one has no room); None for other strategies."""
        if strategy != "STRICT_PACK":
            return None
        self._slices_placed += 1
        return target_node(self.cluster.nodes(), bundle, self._slices_placed - 1)

    def start(self, name: str, module_args: list[str], ready_timeout_s: float = 120.0) -> str:
        return self.start_many({name: module_args}, ready_timeout_s)[name]

    def start_many(self, specs: dict[str, list[str]],
                   ready_timeout_s: float = 120.0) -> dict[str, str]:
        """Start an actor per `name: module_args`, then wait until each service is READY; if one
        fails (or `stopping` is set) all of them are stopped and LaunchError names it."""
        self.place([n for n in specs if n not in self._groups])
        children = [self.spawn(name, args, follow=False) for name, args in specs.items()]
        deadline = time.monotonic() + ready_timeout_s
        for child in children:
            info = self._ready(child, deadline)
            if not child.address:
                self._stop(children, STOP_GRACE_S)
                status = info.get("status") if info else None
                why = ("the launcher is stopping" if self.stopping.is_set() else
                       info.get("error") if info and info.get("error") else
                       f"it exited with status {status} before READY" if status is not None else
                       f"it did not become ready in {ready_timeout_s:.0f}s")
                raise LaunchError(f"{child.name} (Ray actor): {why}; its log "
                                  f"{self.log_path(child.name)} ends:\n"
                                  + (info or {}).get("log_tail", ""))
        return {child.name: child.address for child in children}

    def _ready(self, child: RayChild, deadline: float) -> dict | None:
        import ray  # noqa: PLC0415
        ref = child.actor.ready.remote(max(0.0, deadline - time.monotonic()))
        while not self.stopping.is_set():
            done, _ = ray.wait([ref], timeout=0.2)
            if done:
                try:
                    info = ray.get(ref)
                except ray.exceptions.RayError as e:
                    return {"error": f"its actor failed: {type(e).__name__}: {e}"}
                self._update(child, info)
                return info
            if time.monotonic() > deadline + CALL_TIMEOUT_S:
                return None
        return None

    def spawn(self, name: str, module_args: list[str], follow: bool = True) -> RayChild:
        """Start `name`'s actor without waiting for its service (a restart, an added worker);
        `follow`: its address is filled in, on a thread, once it is READY."""
        import ray  # noqa: PLC0415
        from ray.util.scheduling_strategies import \
            PlacementGroupSchedulingStrategy  # noqa: PLC0415
        role = name.partition("-")[0]
        options = dict(max_restarts=MAX_RESTARTS, max_concurrency=4, num_cpus=ACTOR_CPUS,
                       num_gpus=self.worker_gpus if role in WORKER_ROLES else 0)
        if name in self._groups:
            pg, k = self._groups[name]
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=k)
        else:
            options["scheduling_strategy"] = self._where(role)
        actor = _host_class().options(**options).remote(
            name, list(module_args), passed_env(self.env), self.log_dir,
            bind_node=self.external_bind and role != "gateway")
        child = RayChild(name, actor, list(module_args))
        with self._lock:
            self.children[name] = child
        if follow:
            threading.Thread(target=self._ready, args=(child, time.monotonic() + 600.0),
                             daemon=True).start()
        return child

    def _where(self, role: str):
        """A service outside the placement groups: the gateway on kvfleet up's node (its --host
        is that node's), routers spread over the nodes."""
        from ray.util.scheduling_strategies import \
            NodeAffinitySchedulingStrategy  # noqa: PLC0415
        if role == "gateway" and self.cluster.node_id:
            return NodeAffinitySchedulingStrategy(self.cluster.node_id, soft=False)
        return "SPREAD"

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    # -- acting on one
    def kill(self, name: str) -> None:
        """SIGKILL the service, as a crash would (the supervisor's unresponsive kill)."""
        self._call(self.children[name], "kill")

    def signal(self, name: str, sig: int) -> None:
        self._call(self.children[name], "signal", sig)

    def stop(self, name: str, grace_s: float = STOP_GRACE_S) -> None:
        child = self.children.get(name)
        if child is not None:
            self._stop([child], grace_s)

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """Every service stopped, every actor killed, and a local cluster shut down."""
        self.stopping.set()
        self._stop(list(self.children.values()), grace_s)
        for pg in {id(g): g for g, _ in self._groups.values()}.values():
            _quietly(lambda pg=pg: __import__("ray").util.remove_placement_group(pg))
        if self.cluster.owned:
            self.cluster.shutdown()

    def _stop(self, children: list[RayChild], grace_s: float) -> None:
        import ray  # noqa: PLC0415
        with self._lock:
            for child in children:
                if self.children.get(child.name) is child:
                    del self.children[child.name]
        refs = [child.actor.stop.remote(grace_s) for child in children]
        _quietly(lambda: ray.wait(refs, num_returns=len(refs), timeout=grace_s + 2.0))
        for child in children:
            _quietly(lambda c=child: ray.kill(c.actor, no_restart=True))
            child.proc.status = child.proc.status if child.proc.status is not None else 0

    def _call(self, child: RayChild, method: str, *args):
        import ray  # noqa: PLC0415
        try:
            return ray.get(getattr(child.actor, method).remote(*args), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayError as e:
            self.say(f"kvfleet up: {child.name}'s actor did not take {method}: "
                     f"{type(e).__name__}")
            return None

    # -- watching
    def _watch(self) -> None:
        """Every WATCH_EVERY_S: each actor's service, to see Ray's restarts, a drained service's
        end and an actor Ray gave up on."""
        while not self.stopping.wait(WATCH_EVERY_S):
            with self._lock:
                children = list(self.children.values())
            for child in children:
                if child.proc.status is None:
                    self._look(child)

    def _look(self, child: RayChild) -> None:
        import ray  # noqa: PLC0415
        try:
            info = ray.get(child.actor.info.remote(), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.RayActorError as e:
            # a restarting actor holds calls until it runs; one Ray gave up on refuses them
            child.refusals += 1
            if child.refusals >= GONE_AFTER and not self.stopping.is_set():
                self.say(f"kvfleet up: {child.name}'s actor is gone for good "
                         f"({type(e).__name__}); the supervisor restarts it")
                child.proc.status = RESTART_STATUS
            return
        except (ray.exceptions.RayError, TimeoutError):
            return                              # restarting: it answers once it runs again
        child.refusals = 0
        self._update(child, info)
        if info["draining"] and info["status"] is not None:
            _quietly(lambda: ray.kill(child.actor, no_restart=True))
            child.proc.status = info["status"]

    def _restarted(self, child: RayChild, pid: int) -> RayChild:
        """Ray restarted `child`'s actor: a new child under its name, not READY until its new
        service says so (the health watch and the banner start over, as for a restarted
        process)."""
        fresh = RayChild(child.name, child.actor, child.module_args, restarts=child.restarts + 1)
        with self._lock:
            if self.children.get(child.name) is child:
                self.children[child.name] = fresh
        self.say(f"kvfleet up: {child.name} was restarted by Ray: its service (pid "
                 f"{child.proc.pid}) died, pid {pid} runs now (restart {fresh.restarts})")
        return fresh

    def _update(self, child: RayChild, info: dict) -> None:
        old = child.proc.pid
        if old is not None and info["pid"] != old:
            child = self._restarted(child, info["pid"])
        child.proc.pid = info["pid"]
        child.node_id, child.node_ip = info.get("node_id", ""), info.get("node_ip", "")
        if info["address"]:
            child.address = info["address"]
            child.lines[:] = info["lines"]
            child.ready.set()


_HOST = None


def _host_class():
    """ServiceHost as a Ray actor class (made once: Ray is imported only under --ray)."""
    global _HOST
    if _HOST is None:
        import ray  # noqa: PLC0415
        _HOST = ray.remote(ServiceHost)
    return _HOST


def _quietly(action: Callable[[], object]) -> None:
    try:
        action()
    except Exception:  # noqa: BLE001 - stopping: an actor or group already gone is fine
        pass


# ------------------------------------------------------------------ kvfleet up --ray

def add_args(p) -> None:
    p.add_argument("--ray", nargs="?", const=LOCAL, default=None, metavar="ADDRESS",
                   help="start every service as a Ray actor (services/cli/ray_fleet.py): on a "
                        "local Ray cluster bound to 127.0.0.1 (no ADDRESS), or on the cluster at "
                        "ADDRESS; every listener is on the --port-base table (a free base is "
                        "found when none is given)")
    p.add_argument("--ray-slice", choices=sorted(SLICE_STRATEGIES), default=None,
                   help="with --ray: pack (default) puts prefill-i and decode-i on one node "
                        "(STRICT_PACK; slices spread over the nodes); spread puts them on two "
                        "(STRICT_SPREAD; the KV crosses the network)")
    p.add_argument(bind.FLAG, action="store_true",
                   help="with --ray: routers and workers listen on their Ray node's address and "
                        "advertise it (needed when the cluster spans hosts); off: 127.0.0.1 only")


def check_args(args) -> None:
    """The Ray-only flags without --ray: one line, before anything starts."""
    if getattr(args, "ray", None):
        return
    for flag, given in ((bind.FLAG, getattr(args, "allow_external_bind", False)),
                        ("--ray-slice", getattr(args, "ray_slice", None))):
        if given:
            raise SystemExit(f"kvfleet up: {flag} is for a Ray fleet (--ray); a fleet of local "
                             "processes listens on 127.0.0.1 (the gateway on --host)")


def pin_ports(args, plan_of: Callable[[int], list]) -> None:
    """Under --ray every listener has a fixed port, so that a service Ray restarts comes back on
    it: the gateway's 0 ports mean the table's, and without --port-base the first base whose
    `plan_of(base)` ports are all free is taken."""
    for flag in ("http_port", "grpc_port"):
        if getattr(args, flag, None) == 0:
            setattr(args, flag, None)
    if args.port_base is not None:
        return
    bases = list(range(PORT_BASE_FROM, PORT_BASE_TO, PORT_BASE_STEP))
    random.shuffle(bases)                  # two fleets starting at once seldom try the same one
    for base in bases:
        if ports.taken(plan_of(base)) is None:
            args.port_base = base
            return
    raise SystemExit(f"kvfleet up --ray: no free --port-base from {PORT_BASE_FROM} to "
                     f"{PORT_BASE_TO}; give one")


def launcher_for(args, child_env: dict[str, str]) -> RayLauncher:
    """Join (or start) the cluster and make the launcher of `kvfleet up --ray`."""
    try:
        cluster = RayCluster.connect(args.ray)
    except Exception as e:  # noqa: BLE001 - Ray's own errors: one line, not a traceback
        raise SystemExit(f"kvfleet up --ray {args.ray}: cannot start or join the Ray cluster: "
                         f"{type(e).__name__}: {e}") from None
    external = getattr(args, "allow_external_bind", False)
    networks = (getattr(args, "allowed_networks", None)
                or env.ALLOWED_NETWORKS.get())
    why = check_nodes(cluster.node_ips(), cluster.node_id, external, args.redis_url, networks)
    if why:
        cluster.shutdown()
        raise SystemExit(f"kvfleet up --ray {args.ray}: {why}")
    gpus = gpus_per_worker(cluster.gpus, getattr(args, "device", None),
                           getattr(args, "tensor_parallel", 1))
    return RayLauncher(cluster, env=child_env, worker_gpus=gpus, external_bind=external,
                       slices_as=getattr(args, "ray_slice", None) or "pack")


def banner(launcher) -> list[str]:
    """The banner's Ray line (none for a local-process fleet)."""
    if not isinstance(launcher, RayLauncher):
        return []
    c = launcher.cluster
    where = f"local cluster, its files in {c.temp_dir}" if c.owned else "joined"
    binds = "node addresses" if launcher.external_bind else "127.0.0.1"
    return [f"  ray          {c.address} ({where}; {launcher.worker_gpus} GPU(s) per worker; "
            f"slices {launcher.slice_strategy}; services on {binds})",
            *(f"  {NODE_PREFIX:<12} {name} {child.node_id} {child.node_ip}"
              for name, child in sorted(launcher.children.items()))]
