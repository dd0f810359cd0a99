"""The tenant-fair order of the router's wait queue, and the prefill work ahead of a tenant's
request on a worker. Pure functions: the Redis wait queue (services/state/wait_queue.py), the router
(services/router/service.py, predict.py) and the discrete-event simulator's queue
(services/planner/sim_admission.py) all order waiters with these, so the simulation runs the
router's policy, not a copy of it.

Within a class, waiters are served by start-time fair queuing (SFQ) over tenants, one request as
the unit of service:

  * the class keeps a virtual time V and each tenant t its virtual service `served[t]`;
  * tenant t's waiters stand in deadline order; its k-th (from 0) has the start tag
        S = max(V, served[t]) + k / weight[t];
  * the order is by start tag, ties by deadline (then tenant name);
  * when one of t's waiters is admitted, t is charged: B = max(V, served[t]), served[t] = B + 1/w,
    and V = B. So a tenant with nothing waiting comes back at V (no banked credit), a backlogged
    tenant's later waiters stand behind every other tenant's earlier turns, and over a long run the
    tenants that keep waiters are admitted in proportion to their weights (SFQ: Goyal, Vin and
    Cheng, SIGCOMM 1996). No tenant starves: each admission moves V to the head's start tag, and
    a tenant's head is at most 1/w_min behind the others'.

Protected waiters (a critical tenant, or one under its guaranteed KV: admission.protected) stand
ahead of every borrower, among themselves by deadline, and are not charged.

On a worker, the engine schedules a class's prefill by weighted deficit round robin over tenants
(services/engine/fairness.py): `tokens_ahead` counts what a new request of a tenant waits behind in
that order (services/engine/admission.py's late rejection counts it the same way).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from services.engine.fairness import drr_others_ahead

EPS = 1e-9          # start tags this close are equal (sums of 1/weight in floating point)


@dataclass(frozen=True, slots=True)
class Line:
    """One tenant's unprotected waiters in a class: how many, and its weight and start."""

    count: int
    weight: float
    start: float        # max(V, served[t]): the start tag of its first waiter


def start_of(v: float, served: float) -> float:
    return max(v, served)


def tag(line: Line, rank: int) -> float:
    """The start tag of a tenant's waiter at `rank` (0: its earliest deadline)."""
    return line.start + rank / line.weight


def charge(v: float, served: float, weight: float) -> tuple[float, float]:
    """(V, served[t]) after one of t's waiters was admitted."""
    begin = start_of(v, served)
    return begin, begin + 1.0 / weight


def _before(a: tuple[float, float, str], b: tuple[float, float, str]) -> bool:
    """Whether key a = (tag, deadline, tenant) is served before key b."""
    if not _same(a[0], b[0]):
        return a[0] < b[0]
    return (a[1], a[2]) < (b[1], b[2])


def ties(tenant: str, rank: int, lines: Mapping[str, Line]) -> list[tuple[str, int]]:
    """(u, j): the other tenants' waiters whose start tag equals that of tenant's waiter at `rank`
    (only their deadlines decide which goes first: `ahead` needs them)."""
    mine = tag(lines[tenant], rank)
    out = []
    for u, line in lines.items():
        if u != tenant and line.count > 0:
            j = _first_not_before(mine, line)
            if j < line.count and _same(tag(line, j), mine):
                out.append((u, j))
    return out


def ahead(tenant: str, rank: int, deadline: float, lines: Mapping[str, Line],
          tie_deadlines: Mapping[tuple[str, int], float]) -> int:
    """Unprotected waiters served before tenant's waiter at `rank` with `deadline` (it need not be
    queued yet: `lines[tenant]` then counts the others as they are). `tie_deadlines[(u, j)]` is the
    deadline of tenant u's j-th waiter, for each (u, j) of `ties`."""
    mine = (tag(lines[tenant], rank), deadline, tenant)
    n = rank
    for u, line in lines.items():
        if u == tenant or line.count <= 0:
            continue
        j = _first_not_before(mine[0], line)
        n += j
        if j < line.count and _same(tag(line, j), mine[0]) \
                and (tie_deadlines[(u, j)], u) < (deadline, tenant):
            n += 1                                       # a tie its deadline wins
    return n


def _same(a: float, b: float) -> bool:
    return abs(a - b) <= EPS * max(1.0, abs(a), abs(b))


def _first_not_before(start: float, line: Line) -> int:
    """How many of `line`'s waiters have a start tag strictly below `start`."""
    x = (start - line.start) * line.weight
    j = max(0, min(line.count, math.ceil(x)))
    while j > 0 and _same(tag(line, j - 1), start):
        j -= 1                  # x was a hair over an integer: that waiter ties
    while j < line.count and tag(line, j) < start and not _same(tag(line, j), start):
        j += 1
    return j


def merged(lines: Mapping[str, Line], deadlines: Mapping[str, Sequence[float]]) -> Iterator[
        tuple[str, int]]:
    """(tenant, rank) of every unprotected waiter, in the order served (the order `ahead`
    counts); `deadlines[t]` is t's waiters' deadlines, sorted."""
    nxt = {t: 0 for t, line in lines.items() if line.count > 0}
    while nxt:
        keys = {t: (tag(lines[t], k), deadlines[t][k], t) for t, k in nxt.items()}
        first = next(iter(keys))
        for t in keys:
            if _before(keys[t], keys[first]):
                first = t
        yield first, nxt[first]
        nxt[first] += 1
        if nxt[first] >= lines[first].count:
            del nxt[first]


def worker_tokens_ahead(w, traffic_class: str, tenant: str,
                        weights: Mapping[str, float]) -> int:
    """`tokens_ahead` on worker stats `w` (a pb.WorkerStats publishing `prefill_queues`)."""
    queued: dict[str, int] = {}
    for q in w.prefill_queues:
        if q.traffic_class == traffic_class:
            queued[q.tenant] = queued.get(q.tenant, 0) + q.tokens
    return tokens_ahead(w.queued_prefill_tokens_ahead[traffic_class], queued, tenant, weights)


def tokens_ahead(blind_ahead: int, queued: Mapping[str, int], tenant: str,
                 weights: Mapping[str, float]) -> int:
    """Prefill tokens a new request of `tenant` waits behind on a worker: `blind_ahead` (every
    uncomputed prompt token of its class and of higher class priorities) less its class's queue,
    plus that queue in the engine's DRR order (`queued`: its class's uncomputed tokens by tenant):
    its own tenant's, and of each other tenant u at most weight_u / weight_own times that."""
    own = queued.get(tenant, 0)
    others = drr_others_ahead(own, tenant, queued, weights)
    return max(0, blind_ahead - sum(queued.values())) + own + others
