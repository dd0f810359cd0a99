"""Orders to a running `kvfleet up`: add a worker to a pool, or drain one (`kvfleet rebalance
--apply --target local` gives them).

The channel is the fleet's Redis:

| key                              | holds                                                          |
|----------------------------------|----------------------------------------------------------------|
| `{ns}fleet:orders`               | list of sealed `FleetOrder`s (RPUSH by the giver, LPOP by up)  |
| `{ns}fleet:order:<order_id>`     | the sealed `OrderResult` `kvfleet up` wrote (TTL RESULT_TTL_S) |
| `{ns}rebalance:last_change_s`    | unix seconds of the last applied change (the cool-down's)      |
| `{ns}fleet:launcher`             | `local` or `ray`: how the kvfleet up taking orders runs workers |

Orders and results are JSON sealed as the worker records are (services/state/records.py: an HMAC
keyed by the fleet token), so only a holder of the token can order the fleet about; an order that
fails its seal or its schema is dropped with one line on stderr, never acted on.

What `kvfleet up` does with them (`OrderDesk.poll`, called from its supervise loop):
  add ROLE     starts `ROLE-<next index>` with the arguments the first worker of that role was
               started with, on its ports of the --port-base table when the fleet has one (always
               under `kvfleet up --ray`, so that Ray's restart of it comes back on them), else on
               free ports; the supervisor restarts it as any child (on its port)
  drain ROLE   picks the newest worker of that role (or the one named), tells the supervisor not
               to restart it, and sends it SIGUSR1: the worker leaves Redis (routers stop placing
               on it), finishes what it holds, then exits (services/worker/drain.py)
"""
from __future__ import annotations

import enum
import json
import re
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable

from services.cli import ports
from services.cli.ports import CHILD_FLAGS
from services.state.records import RecordSeal, RejectedRecord

ORDERS_KEY = "fleet:orders"
RESULT_KEY = "fleet:order:"
LAST_CHANGE_KEY = "rebalance:last_change_s"
LAUNCHER_KEY = "fleet:launcher"         # what carries orders out: "local" or "ray" (kvfleet up --ray)
RESULT_TTL_S = 3600
MAX_ORDERS_A_POLL = 8
ROLES = ("prefill", "decode", "mixed")
SEAL_KIND = "fleet-order"
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class OrderError(ValueError):
    """An order (or result) that is not one: its schema or its seal is wrong."""


class Action(str, enum.Enum):
    ADD = "add"
    DRAIN = "drain"


@dataclass(frozen=True)
class FleetOrder:
    action: Action
    role: str
    order_id: str
    worker_id: str | None = None         # drain: this worker (default: the role's newest)

    def __post_init__(self) -> None:
        if not isinstance(self.action, Action):
            raise OrderError(f"order action {self.action!r} is not one of "
                             f"{[a.value for a in Action]}")
        if self.role not in ROLES:
            raise OrderError(f"order role {self.role!r} is not one of {ROLES}")
        for name, value in (("order_id", self.order_id), ("worker_id", self.worker_id)):
            if value is not None and not (isinstance(value, str) and _ID.match(value)):
                raise OrderError(f"order {name} {value!r} is not 1-64 of [A-Za-z0-9_.-]")

    @classmethod
    def new(cls, action: Action, role: str, worker_id: str | None = None) -> "FleetOrder":
        return cls(action, role, uuid.uuid4().hex[:16], worker_id)

    def encode(self, seal: RecordSeal) -> bytes:
        payload = json.dumps({**asdict(self), "action": self.action.value}).encode()
        return seal.seal(SEAL_KIND, "order", payload)

    @classmethod
    def decode(cls, raw: bytes, seal: RecordSeal) -> "FleetOrder":
        body = _open(raw, seal, "order")
        try:
            return cls(Action(body["action"]), body["role"], body["order_id"],
                       body.get("worker_id"))
        except (KeyError, TypeError, ValueError) as e:
            raise OrderError(f"order {body!r}: {e}") from None


@dataclass(frozen=True)
class OrderResult:
    order_id: str
    accepted: bool
    worker_id: str | None            # the worker started or draining
    detail: str

    def encode(self, seal: RecordSeal) -> bytes:
        return seal.seal(SEAL_KIND, "result", json.dumps(asdict(self)).encode())

    @classmethod
    def decode(cls, raw: bytes, seal: RecordSeal) -> "OrderResult":
        body = _open(raw, seal, "result")
        try:
            return cls(str(body["order_id"]), bool(body["accepted"]), body.get("worker_id"),
                       str(body["detail"]))
        except (KeyError, TypeError) as e:
            raise OrderError(f"order result {body!r}: {e}") from None


def _open(raw: bytes, seal: RecordSeal, what: str) -> dict:
    try:
        body = json.loads(seal.open(SEAL_KIND, what, raw))
    except RejectedRecord as e:
        raise OrderError(f"{what} refused: {e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise OrderError(f"{what} is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise OrderError(f"{what} is not a JSON object")
    return body


# --- the giver's side (kvfleet rebalance) ---------------------------------------------------

def give(redis, ns: str, order: FleetOrder, seal: RecordSeal) -> None:
    """Queue `order` (a sync redis client, bytes mode)."""
    redis.rpush(ns + ORDERS_KEY, order.encode(seal))


def result_of(redis, ns: str, order_id: str, seal: RecordSeal) -> OrderResult | None:
    raw = redis.get(ns + RESULT_KEY + order_id)
    return None if raw is None else OrderResult.decode(raw, seal)


# --- kvfleet up's side ----------------------------------------------------------------------

def worker_index(name: str, role: str) -> int | None:
    prefix = role + "-"
    tail = name[len(prefix):] if name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def clone_args(template: list[str], old_id: str, new_id: str) -> list[str]:
    """A worker's start arguments for another worker of its role: its id replaced, its port
    flags dropped (the new worker listens on free ports)."""
    out, skip = [], False
    port_flags = set(CHILD_FLAGS.values()) | {"--port"}
    for i, arg in enumerate(template):
        if skip:
            skip = False
            continue
        if arg in port_flags:
            skip = True
            continue
        out.append(new_id if arg == old_id and i > 0 and template[i - 1] == "--worker-id" else arg)
    return out


def table_ports(base: int | None, template: list[str], name: str
                ) -> tuple[list[ports.Listener], str]:
    """The listeners of an added worker `name` on the --port-base table, and why none when it
    gets free ports instead (no table; its index past the table's room). It has the listeners
    its template was started with: a KV receiver only if the template had one (tcp backend)."""
    if base is None:
        return [], "the fleet has no --port-base table"
    try:
        return ports.plan(base, [name], kv="--kv-port" in template), ""
    except ValueError as e:
        return [], str(e)


@dataclass
class OrderDesk:
    """Reads the orders queued in Redis and carries them out on `kvfleet up`'s children.
    `launcher`, `supervisor`: up's own; `redis`: a sync client (bytes)."""

    launcher: object
    supervisor: object
    redis: object
    seal: RecordSeal
    ns: str = "kvfleet:"
    say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    announce: Callable[[str], None] = lambda line: print(line, flush=True)
    port_base: int | None = None        # up's --port-base: added workers take their table ports

    def __post_init__(self) -> None:
        # the first worker of each role at start: whom an added worker is made like
        self.templates: dict[str, tuple[str, list[str]]] = {}
        for name, child in self.launcher.children.items():
            for role in ROLES:
                if worker_index(name, role) is not None and role not in self.templates:
                    self.templates[role] = (name, list(child.module_args))
        self._pending: set[str] = set()     # added workers not yet pinned to their port
        self._redis_down = False
        self._announced = False             # the launcher's kind is in Redis (said again after an outage)

    def poll(self) -> list[OrderResult]:
        self._pin_ready()
        try:
            raws = [self.redis.lpop(self.ns + ORDERS_KEY) for _ in range(MAX_ORDERS_A_POLL)]
        except Exception as e:  # noqa: BLE001 - Redis down: orders wait; the fleet serves on
            if not self._redis_down:
                self.say(f"kvfleet up: cannot read fleet orders from Redis ({e}); retrying")
            self._redis_down = True
            return []
        if self._redis_down or not self._announced:
            self._announce_launcher()
        self._redis_down = False
        results = []
        for raw in filter(None, raws):
            try:
                order = FleetOrder.decode(raw, self.seal)
            except OrderError as e:
                self.say(f"kvfleet up: dropped a fleet order: {e}")
                continue
            result = self.carry_out(order)
            results.append(result)
            try:
                self.redis.set(self.ns + RESULT_KEY + order.order_id, result.encode(self.seal),
                               ex=RESULT_TTL_S)
            except Exception as e:  # noqa: BLE001 - the giver then sees no result
                self.say(f"kvfleet up: could not write the result of order {order.order_id}: {e}")
        return results

    def _announce_launcher(self) -> None:
        try:
            self.redis.set(self.ns + LAUNCHER_KEY, getattr(self.launcher, "kind", "local"))
            self._announced = True
        except Exception as e:  # noqa: BLE001 - said again once Redis answers
            self.say(f"kvfleet up: could not say in Redis how it runs workers: {e}")

    def carry_out(self, order: FleetOrder) -> OrderResult:
        if order.action is Action.ADD:
            return self._add(order)
        return self._drain(order)

    def _add(self, order: FleetOrder) -> OrderResult:
        template = self.templates.get(order.role)
        if template is None:
            return OrderResult(order.order_id, False, None,
                               f"this fleet started no {order.role} worker to copy")
        name = f"{order.role}-{self._next_index(order.role)}"
        plan, why = table_ports(self.port_base, template[1], name)
        busy = ports.taken(plan)
        if busy is not None:
            plan, why = [], f"its table port {busy.port} ({busy.kind}) is in use"
        if not plan and self.port_base is not None:
            self.say(f"kvfleet up: {name} takes free ports: {why}")
        self.launcher.spawn(name, clone_args(template[1], template[0], name)
                            + ports.child_args(plan, name))
        if not plan:
            self._pending.add(name)             # pinned to the port it gets, once serving
        self.announce(f"  added        {name} (order {order.order_id})")
        return OrderResult(order.order_id, True, name, f"started {name}")

    def _drain(self, order: FleetOrder) -> OrderResult:
        serving = [n for n in self.launcher.children if worker_index(n, order.role) is not None
                   and n not in self.supervisor.retiring]
        if order.worker_id is not None:
            name = order.worker_id if order.worker_id in serving else None
        else:
            name = max(serving, key=lambda n: worker_index(n, order.role), default=None)
        if name is None:
            return OrderResult(order.order_id, False, None,
                               f"no {order.worker_id or order.role} worker to drain")
        if len(serving) <= 1:
            return OrderResult(order.order_id, False, None,
                               f"{name} is the last {order.role} worker: not drained")
        self.supervisor.retire(name)
        # it may have died meanwhile: retired, it is not restarted
        self.launcher.signal(name, signal.SIGUSR1)
        self.announce(f"  draining     {name} (order {order.order_id})")
        return OrderResult(order.order_id, True, name, f"draining {name}")

    def _next_index(self, role: str) -> int:
        used = [worker_index(n, role) for n in (*self.launcher.children, *self.supervisor.retired)]
        return 1 + max((i for i in used if i is not None), default=-1)

    def _pin_ready(self) -> None:
        """An added worker, once serving, is restarted on the port it got (as the others are)."""
        for name in list(self._pending):
            child = self.launcher.children.get(name)
            if child is None:
                self._pending.discard(name)
            elif child.address:
                self.supervisor.pinned[name] = ["--port", child.address.rsplit(":", 1)[1]]
                self._pending.discard(name)


def launcher_kind(redis, ns: str) -> str | None:
    """How the kvfleet up taking this Redis's orders runs its workers (None: no such fleet)."""
    raw = redis.get(ns + LAUNCHER_KEY)
    return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


def mark_change(redis, ns: str, now_unix_s: float | None = None) -> None:
    redis.set(ns + LAST_CHANGE_KEY, repr(time.time() if now_unix_s is None else now_unix_s))


def last_change(redis, ns: str) -> float | None:
    raw = redis.get(ns + LAST_CHANGE_KEY)
    try:
        return None if raw is None else float(raw)
    except ValueError:
        return None
