"""Invariants of the scheduler under random arrivals, finishes and cancels (hypothesis).

Whatever happens: reserved blocks never exceed capacity; no request computes without blocks
under its reservation; every block returns to the pool when its last reference ends; no tenant
exceeds its caps; every running decode sequence advances every iteration (except one the
`predict` policy preempts).
"""
from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.engine.admission import bounded_output, cdiv
from services.engine.config import Tenant
from services.engine.request import Status
from services.engine.scheduler import MIN_CHUNK, attention_pairs
from tests.engine.scheduler_helpers import EOS, make_request, make_scheduler

TENANTS = (Tenant("a", max_active_seqs=3), Tenant("b", max_reserved_blocks=40),
           Tenant("c", weight=2.0, classes=("interactive", "batch")))
CLASSES = {"a": ("interactive", "document", "batch"), "b": ("interactive", "document", "batch"),
           "c": ("interactive", "batch")}


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["reserve", "predict"]), caching=st.booleans(),
                chunk=st.sampled_from([8, 32]), attention=st.sampled_from([0, 300, 2000]))
    def setup(self, policy, caching, chunk, attention):
        self.sched, self.clock = make_scheduler(
            num_blocks=64, block_size=4, max_model_len=128, prefix_caching=caching,
            tenants=TENANTS, token_budget=32, chunk_size=chunk, max_running=16, admission=policy,
            reject_late=False, max_prefill_attention=attention)
        self.pool = self.sched.pool
        self.live = []

    @rule(tenant=st.sampled_from("abc"), cls_index=st.integers(0, 2),
          prompt_len=st.integers(1, 60), max_tokens=st.integers(1, 20),
          shared_prefix=st.booleans())
    def arrive(self, tenant, cls_index, prompt_len, max_tokens, shared_prefix):
        cls = CLASSES[tenant][cls_index % len(CLASSES[tenant])]
        prompt = ([300 + i for i in range(prompt_len)] if shared_prefix
                  else [1000 + len(self.live) * 61 + i for i in range(prompt_len)])
        req = make_request(self.sched, prompt=prompt, tenant=tenant, cls=cls,
                           max_tokens=max_tokens, clock=self.clock)
        need = cdiv(min(prompt_len + min(max_tokens, req.traffic_class.output_cap), 128), 4)
        cap = self.sched.config.tenant(tenant).max_reserved_blocks or 64
        if prompt_len + max_tokens > 128 or need > min(64, cap):
            return                                   # the validator refuses these up front
        self.sched.add(req)
        self.live.append(req)

    @rule(eos=st.lists(st.booleans(), min_size=16, max_size=16), advance=st.floats(0, 2))
    def iterate(self, eos, advance):
        self.clock.now += advance
        decoding = [r for r in self.sched.running.values() if r.is_decoding]
        before = {r.request_id: r.num_output_tokens for r in decoding}
        chats_wait = any(self.sched.queues["interactive"].values())
        out = self.sched.schedule()
        if chats_wait:
            self.check_capped_shares(out)
        for chunk in out.chunks:                       # computes only inside its own blocks
            held = self.pool.held(chunk.request.request_id)
            assert held * 4 >= chunk.start_pos + chunk.num_tokens
            assert chunk.request.status == Status.RUNNING
        self.check_attention_cap(out)
        scheduled = {c.request.request_id for c in out.decodes}
        preempted = {r.request_id for r in out.preempted}
        assert set(before) - preempted <= scheduled   # every running decode goes
        sampled = [EOS if eos[i % 16] else 7 for i, c in enumerate(
            [c for c in out.chunks if c.sample])]
        self.sched.update(out, sampled)
        for r in decoding:
            if r.request_id not in preempted:
                assert r.num_output_tokens == before[r.request_id] + 1 or r.is_finished

    def check_attention_cap(self, out):
        """While sequences decode, each prefill chunk either fits the attention left after the
        chunks before it, or is a floor chunk of at most MIN_CHUNK tokens, one per class at
        most (a class's queue never advances all together by floor chunks)."""
        cap = self.sched.config.max_prefill_attention
        if not (cap and out.decodes):
            return
        spent, floors = 0, Counter()
        for c in out.prefills:
            spent += attention_pairs(c.start_pos, c.num_tokens)
            if spent > cap:
                floors[c.request.traffic_class.name] += 1
                assert c.num_tokens <= MIN_CHUNK, (c.start_pos, c.num_tokens, spent, cap)
        assert all(n <= 1 for n in floors.values()), floors

    def check_capped_shares(self, out):
        """While chats wait and sequences decode, a capped class (documents, batch) spends at most
        its share of the attention pairs, or advances by one floor chunk alone."""
        cap = self.sched.config.max_prefill_attention
        if not (cap and out.decodes):
            return
        for cls in self.sched.config.classes:
            mine = [c for c in out.prefills if c.request.traffic_class.name == cls.name]
            if cls.share_while_interactive_waits >= 1 or not mine:
                continue
            pairs = sum(attention_pairs(c.start_pos, c.num_tokens) for c in mine)
            floor_alone = len(mine) == 1 and mine[0].num_tokens <= MIN_CHUNK
            share = cls.share_while_interactive_waits
            assert pairs <= share * cap or floor_alone, (cls.name, pairs)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 1000))
    def cancel(self, index):
        self.sched.cancel(self.live[index % len(self.live)].request_id)

    @invariant()
    def pool_is_consistent(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        assert self.pool.num_reserved <= self.pool.num_free <= self.pool.num_blocks

    @invariant()
    def reservations_cover_bounded_output(self):
        if not hasattr(self, "sched") or self.sched.config.admission != "reserve":
            return
        for r in self.sched.running.values():
            covered = (self.pool.held(r.request_id) + self.pool.reserved(r.request_id)) * 4
            assert covered >= min(r.num_tokens + bounded_output(r, self.sched.config), 128)

    @invariant()
    def tenants_within_caps(self):
        if not hasattr(self, "sched"):
            return
        for t in TENANTS:
            ids = self.sched.holding.get(t.name, set())
            if t.max_active_seqs is not None:
                assert len(ids) <= t.max_active_seqs
            if t.max_reserved_blocks is not None:
                committed = sum(self.pool.held(i) + self.pool.reserved(i) for i in ids)
                assert committed <= t.max_reserved_blocks

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for r in self.live:
            self.sched.cancel(r.request_id)
        assert not self.sched.has_work
        assert self.pool.num_free == self.pool.num_blocks
        assert self.pool.num_used == 0 and self.pool.num_reserved == 0
        self.pool.check_invariants()


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestScheduler = SchedulerMachine.TestCase


def test_a_finished_run_returns_every_block():
    """Drain to completion (no cancels): the pool is whole again."""
    sched, _ = make_scheduler(num_blocks=64, tenants=TENANTS, token_budget=32, chunk_size=8,
                              max_running=16)
    reqs = [make_request(sched, prompt_len=5 + 3 * i, tenant="abc"[i % 3], max_tokens=4)
            for i in range(12)]
    for r in reqs:
        sched.add(r)
    from tests.engine.scheduler_helpers import run_until_idle
    run_until_idle(sched)
    assert all(r.status == Status.FINISHED_LENGTH for r in reqs)
    assert sched.pool.num_free == 64 and sched.pool.num_reserved == 0
