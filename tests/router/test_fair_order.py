"""The tenant-fair order of the wait queue (services/router/fair_order.py), as invariants over long
random sequences: no tenant starves, backlogged tenants are admitted in proportion to their
weights, `ahead` counts exactly the waiters the order serves first, and the Redis queue (the
routers') and the simulator's in-process queue agree on the order."""
from __future__ import annotations

import asyncio
import itertools

import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings, strategies as st

from services.planner.sim_admission import WaitLine
from services.router import fair_order
from services.router.fair_order import Line
from services.state.wait_queue import WaitQueue

CLS = "interactive"
TENANTS = ("a", "b", "c", "d")
weights_st = st.fixed_dictionaries({t: st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
                                    for t in TENANTS})


class Driver:
    """The simulator's queue, served strictly in the fair order: the head is admitted."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        self.line = WaitLine(weights)
        self.ids = itertools.count()
        self.deadline = itertools.count(1)
        self.tenant_of: dict[str, str] = {}

    def arrive(self, tenant: str) -> str:
        rid = f"r{next(self.ids)}"
        self.line.enqueue(rid, CLS, float(next(self.deadline)), 0.0, tenant)
        self.tenant_of[rid] = tenant
        return rid

    def serve(self) -> str:
        rid = self.line.first(CLS, 1)[0]
        tenant = self.tenant_of[rid]
        self.line.leave(rid, CLS)
        self.line.admitted(CLS, tenant, self.weights[tenant])
        return tenant

    def waiting(self, tenant: str) -> int:
        return sum(1 for rid in self.line.first(CLS, 10**6) if self.tenant_of[rid] == tenant)


@settings(max_examples=60, deadline=None)
@given(weights=weights_st,
       steps=st.lists(st.one_of(st.sampled_from(TENANTS), st.just("serve")),
                      min_size=50, max_size=600))
def test_no_tenant_waits_longer_than_every_other_tenants_weighted_turn(weights, steps):
    """Once a waiter heads its tenant's line, each other tenant u is admitted at most
    floor(w_u / w_t) + 1 times before it, whatever arrives meanwhile."""
    q = Driver(weights)
    bound = {t: sum(int(weights[u] / weights[t] + 1e-9) + 1 for u in TENANTS if u != t)
             for t in TENANTS}
    passed: dict[str, int] = {}             # tenant -> admissions of others since its head came
    for step in steps:
        if step != "serve":
            q.arrive(step)
        elif q.line.waiting(CLS):
            served = q.serve()
            passed.pop(served, None)
            for t in passed:
                passed[t] += 1
                assert passed[t] <= bound[t], (t, passed[t], bound[t], weights)
        for t in TENANTS:
            if t not in passed and q.waiting(t):
                passed[t] = 0
    while q.line.waiting(CLS):              # and everyone left is served in the end
        q.serve()


@settings(max_examples=60, deadline=None)
@given(weights=weights_st, admissions=st.integers(20, 400),
       refill=st.lists(st.sampled_from(TENANTS), max_size=400))
def test_backlogged_tenants_are_admitted_in_proportion_to_their_weights(weights, admissions,
                                                                        refill):
    """While every tenant keeps waiters, admissions per unit of weight differ between any two
    tenants by at most one turn of each (SFQ's bound: 1/w_t + 1/w_u)."""
    q = Driver(weights)
    for t in TENANTS:
        for _ in range(3):
            q.arrive(t)
    extra = iter(refill)
    served = dict.fromkeys(TENANTS, 0)
    for _ in range(admissions):
        served[q.serve()] += 1
        for t in TENANTS:                   # nobody runs dry: all stay backlogged
            while q.waiting(t) < 2:
                q.arrive(t)
        if (t := next(extra, None)) is not None:
            q.arrive(t)                     # and some send more than that
    for t, u in itertools.combinations(TENANTS, 2):
        gap = abs(served[t] / weights[t] - served[u] / weights[u])
        assert gap <= 1 / weights[t] + 1 / weights[u] + 1e-9, (served, weights)


lines_st = st.dictionaries(
    st.sampled_from(TENANTS),
    st.tuples(st.integers(0, 6), st.sampled_from([0.5, 1.0, 2.0, 3.0]),
              st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 10 / 3])),
    min_size=1)


@settings(max_examples=200, deadline=None)
@given(lines=lines_st, data=st.data())
def test_ahead_counts_exactly_the_waiters_the_order_serves_first(lines, data):
    """Start tags that tie (same virtual start, or sums of 1/weight) are broken by deadline; for
    every waiter, `ahead` equals its place in the merged order."""
    lines_ = {t: Line(n, w, s) for t, (n, w, s) in lines.items()}
    deadlines = {t: sorted(data.draw(st.lists(st.integers(0, 30), min_size=n, max_size=n,
                                              unique=True)))
                 for t, (n, _, _) in lines.items()}
    deadlines = {t: [d + i / 10 for d in ds] for i, (t, ds) in enumerate(deadlines.items())}
    order = list(fair_order.merged(lines_, deadlines))
    assert len(order) == sum(n for n, _, _ in lines.values())
    for place, (t, k) in enumerate(order):
        tied = {(u, j): deadlines[u][j] for u, j in fair_order.ties(t, k, lines_)}
        assert fair_order.ahead(t, k, deadlines[t][k], lines_, tied) == place


def test_a_quiet_tenants_first_waiter_goes_ahead_of_a_floods_backlog():
    q = Driver({t: 1.0 for t in TENANTS})
    flood = [q.arrive("a") for _ in range(20)]
    q.serve()                                # the flood had a turn: its next start is 1
    quiet = q.arrive("b")
    assert q.line.first(CLS, 1) == [quiet]
    assert q.line.ahead(CLS, "c", 1e9) == 1  # a newcomer of a third tenant: behind b's only
    assert flood[1] in q.line.first(CLS, 2)


def test_protected_waiters_go_ahead_of_every_borrower_by_deadline():
    line = WaitLine()
    line.enqueue("borrower", CLS, 1.0, 0.0, "a")
    line.enqueue("late-guaranteed", CLS, 9.0, 0.0, "b", protected=True)
    line.enqueue("guaranteed", CLS, 5.0, 0.0, "c", protected=True)
    assert line.first(CLS, 3) == ["guaranteed", "late-guaranteed", "borrower"]
    assert line.ahead(CLS, "a", 0.5) == 2


ops_st = st.lists(st.one_of(
    st.tuples(st.just("enqueue"), st.sampled_from(TENANTS), st.booleans()),
    st.tuples(st.just("admit"), st.integers(0, 5), st.just(False)),
    st.tuples(st.just("leave"), st.integers(0, 5), st.just(False))), min_size=1, max_size=40)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(weights=weights_st, ops=ops_st)
def test_the_redis_queue_and_the_simulators_queue_keep_the_same_order(redis_url, redis_ns,
                                                                      weights, ops):
    """The same enqueues (some protected), admissions (a waiter near the front leaves and its
    tenant is charged) and departures: every waiter has the same place in both, and a newcomer
    of each tenant would find the same number ahead of it."""
    ns = f"{redis_ns}{next(_runs)}:"

    async def story():
        r = aioredis.Redis.from_url(redis_url, decode_responses=True)
        try:
            queue, line = WaitQueue(r, ns), WaitLine(weights)
            tenant_of, protected, deadline = {}, set(), itertools.count(1)
            for i, (op, arg, flag) in enumerate(ops):
                order = line.first(CLS, 10**6)
                if op == "enqueue":
                    rid, d = f"r{i}", 1e9 + next(deadline)
                    await queue.enqueue(rid, CLS, d, 0.0, arg, flag)
                    line.enqueue(rid, CLS, d, 0.0, arg, flag)
                    tenant_of[rid] = arg
                    if flag:
                        protected.add(rid)
                elif order:
                    rid = order[min(arg, len(order) - 1)]
                    await queue.leave(rid, CLS)
                    line.leave(rid, CLS)
                    if op == "admit" and rid not in protected:
                        t = tenant_of[rid]
                        await queue.admitted(CLS, t, weights[t])
                        line.admitted(CLS, t, weights[t])
                for place, rid in enumerate(line.first(CLS, 10**6)):
                    assert await queue.position(rid, CLS, 0.0, tenant_of[rid], weights) == place
                for t in TENANTS:
                    d = 1e9 + 0.5 + next(deadline)
                    assert await queue.ahead(CLS, t, d, weights) == line.ahead(CLS, t, d)
        finally:
            await r.aclose()
    asyncio.run(story())


_runs = itertools.count()


def test_routers_charging_the_same_tenant_at_once_lose_no_turn(redis_url, redis_ns):
    """Charges race between routers (WATCH/MULTI reruns the loser): 2 x 40 admissions of a tenant
    of weight 2 leave it exactly 40 turns of virtual service."""
    async def story():
        clients = [aioredis.Redis.from_url(redis_url, decode_responses=True) for _ in range(2)]
        try:
            queues = [WaitQueue(c, redis_ns) for c in clients]

            async def charge(q: WaitQueue) -> None:
                for _ in range(40):
                    await q.admitted(CLS, "a", 2.0)
            await asyncio.gather(*(charge(q) for q in queues))
            served = float(await clients[0].hget(f"{redis_ns}waitq:vt:{CLS}", "a"))
            assert served == 40.0
        finally:
            for c in clients:
                await c.aclose()
    asyncio.run(story())
