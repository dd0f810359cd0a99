"""BlockPool stories (block ids, ref counts and counters step by step) and a stateful fuzz."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.engine.block_pool import BlockPool, hash_block_tokens, hash_full_blocks

SALT = "tenant-a"


def admit(pool: BlockPool, owner: str, token_ids: list[int], salt: str = SALT) -> bool:
    """The scheduler's path: look up the prefix, reserve the rest, allocate, cache full blocks."""
    hashes = hash_full_blocks(token_ids, pool.block_size, salt)
    hits = pool.lookup_prefix(hashes)
    need = -(-len(token_ids) // pool.block_size) - len(hits)
    if not pool.reserve(owner, need, shared=hits):
        return False
    pool.allocate(owner, need)
    for block_id, block_hash in zip(pool.block_table(owner), hashes):
        pool.cache_block(block_id, block_hash)
    pool.check_invariants()
    return True


def refs(pool: BlockPool, block_ids: list[int]) -> list[int]:
    return [pool.blocks[i].ref_count for i in block_ids]


def counters(pool: BlockPool) -> tuple[int, ...]:
    return (pool.num_free, pool.num_reserved, pool.num_available, pool.num_used, pool.num_cached)


def test_allocation_inside_a_reservation_never_fails():
    pool = BlockPool(num_blocks=10, block_size=4)
    assert pool.reserve("a", 4) and pool.reserve("b", 6)
    assert (pool.num_free, pool.num_reserved, pool.num_available) == (10, 10, 0)
    assert not pool.reserve("c", 1)  # everything is promised

    # Interleaved allocation, one block at a time, always succeeds and takes the free-list head.
    assert pool.allocate("a") == [0]
    assert pool.allocate("b", 2) == [1, 2]
    assert pool.allocate("a", 3) == [3, 4, 5]
    assert pool.allocate("b", 4) == [6, 7, 8, 9]
    assert pool.block_table("a") == [0, 3, 4, 5] and pool.held("b") == 6
    assert (pool.reserved("a"), pool.reserved("b")) == (0, 0)
    assert counters(pool) == (0, 0, 0, 10, 0)
    pool.check_invariants()

    with pytest.raises(ValueError):
        pool.allocate("a")  # beyond the reservation: a programming error
    with pytest.raises(ValueError):
        pool.allocate("ghost")


def test_overcommitting_reservation_is_refused_and_changes_nothing():
    pool = BlockPool(num_blocks=8, block_size=2)
    assert pool.reserve("a", 5)
    before = counters(pool)
    assert not pool.reserve("b", 4)
    assert counters(pool) == before
    assert list(pool.owners()) == ["a"] and pool.reserved("b") == 0 and pool.block_table("b") == []

    # A prefix hit on a free cached block costs availability too (it leaves the free list).
    pool.free("a")
    assert admit(pool, "c", [1, 2, 3, 4])  # blocks [0, 1], cached
    pool.free("c")
    hits = pool.lookup_prefix(hash_full_blocks([1, 2, 3, 4], 2, SALT))
    assert hits == [0, 1] and refs(pool, hits) == [0, 0]
    assert pool.reserve("d", 7)  # leaves 1 available
    before = counters(pool)
    assert not pool.reserve("e", 0, shared=hits)  # needs 2 revived blocks, 1 available
    assert counters(pool) == before and refs(pool, hits) == [0, 0]
    assert pool.reserve("e", 0, shared=hits[:1])
    assert refs(pool, hits) == [1, 0] and pool.num_available == 0
    pool.check_invariants()


def test_prefix_hit_shares_blocks_within_a_tenant():
    pool = BlockPool(num_blocks=10, block_size=4)
    prompt = list(range(10))  # 2 full blocks + a 2-token tail

    assert admit(pool, "a", prompt)
    assert pool.block_table("a") == [0, 1, 2]
    assert pool.num_cached == 2  # the partial tail block is not cached

    # Cache hit in the common prefix: b shares blocks 0 and 1 and gets a fresh tail block.
    hashes = hash_full_blocks(prompt, 4, SALT)
    assert pool.lookup_prefix(hashes) == [0, 1]
    assert pool.lookup_prefix([hashes[0] + 1, hashes[1]]) == []  # a prefix, not any match
    assert admit(pool, "b", prompt)
    assert pool.block_table("b") == [0, 1, 3]
    assert refs(pool, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert counters(pool) == (6, 0, 6, 4, 2)

    pool.free("a")
    assert refs(pool, [0, 1, 2, 3]) == [1, 1, 0, 1]
    assert pool.num_free == 7 and pool.num_cached == 2
    pool.free("b")
    assert refs(pool, [0, 1, 2, 3]) == [0, 0, 0, 0]
    assert counters(pool) == (10, 0, 10, 0, 2)  # cached blocks stay cached while free
    pool.check_invariants()


def test_other_tenant_gets_no_hit_for_identical_tokens():
    pool = BlockPool(num_blocks=10, block_size=4)
    prompt = list(range(8))
    assert admit(pool, "a", prompt, salt="tenant-a")
    assert pool.lookup_prefix(hash_full_blocks(prompt, 4, "tenant-b")) == []
    assert admit(pool, "b", prompt, salt="tenant-b")
    assert pool.block_table("b") == [2, 3]
    assert refs(pool, [0, 1, 2, 3]) == [1, 1, 1, 1]
    assert pool.num_cached == 4


def test_cached_blocks_are_evicted_oldest_first_after_fresh_ones():
    pool = BlockPool(num_blocks=6, block_size=2)
    a_prompt, b_prompt = [1, 2, 3, 4], [5, 6, 7, 8]
    a_hashes, b_hashes = hash_full_blocks(a_prompt, 2, SALT), hash_full_blocks(b_prompt, 2, SALT)
    assert admit(pool, "a", a_prompt) and admit(pool, "b", b_prompt)
    assert pool.block_table("a") == [0, 1] and pool.block_table("b") == [2, 3]
    pool.free("a")  # LRU tail gets 1, 0 (reverse order)
    pool.free("b")  # then 3, 2
    # Free list now: [4, 5] (never cached) then cached 1, 0, 3, 2 (least recently freed first).
    assert pool.reserve("c", 6)
    assert pool.allocate("c", 2) == [4, 5]
    assert pool.num_cached == 4  # fresh blocks first: nothing evicted yet
    assert pool.allocate("c") == [1]
    assert pool.num_cached == 3 and pool.lookup_prefix(a_hashes) == [0]
    assert pool.allocate("c") == [0]
    assert pool.lookup_prefix(a_hashes) == [] and pool.lookup_prefix(b_hashes) == [2, 3]
    assert pool.allocate("c", 2) == [3, 2]
    assert counters(pool) == (0, 0, 0, 6, 0)
    pool.check_invariants()


def test_free_releases_tail_blocks_before_head_blocks():
    pool = BlockPool(num_blocks=3, block_size=1)
    prompt = [7, 8, 9]
    hashes = hash_full_blocks(prompt, 1, SALT)
    assert admit(pool, "a", prompt) and pool.block_table("a") == [0, 1, 2]
    pool.free("a")
    # Tail first: the sequence's last block is evicted first, its head survives longest.
    assert pool.reserve("b", 1) and pool.allocate("b") == [2]
    assert pool.lookup_prefix(hashes) == [0, 1]
    assert pool.reserve("b", 1) and pool.allocate("b") == [1]
    assert pool.lookup_prefix(hashes) == [0]

    # Uncached blocks go back to the head, so they are reused before any cached block.
    pool.free("b")
    assert pool.reserve("c", 2) and pool.allocate("c", 2) == [2, 1]
    assert pool.lookup_prefix(hashes) == [0]


def test_partial_blocks_are_never_hashed():
    assert hash_full_blocks([1, 2, 3], 4, SALT) == []
    seven = hash_full_blocks(list(range(7)), 4, SALT)
    eight = hash_full_blocks(list(range(8)), 4, SALT)
    assert len(seven) == 1 and len(eight) == 2 and seven[0] == eight[0]
    pool = BlockPool(num_blocks=4, block_size=4)
    assert admit(pool, "a", list(range(7)))
    assert pool.block_table("a") == [0, 1]
    assert pool.blocks[0].block_hash == seven[0] and pool.blocks[1].block_hash is None
    assert pool.num_cached == 1


def test_growing_a_reservation():
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.reserve("a", 2) and pool.allocate("a", 2) == [0, 1]
    assert pool.reserved("a") == 0
    assert pool.reserve("a", 3)  # the `predict` policy grows it on demand
    assert (pool.reserved("a"), pool.held("a"), pool.num_available) == (3, 2, 1)
    assert pool.allocate("a") == [2]
    before = counters(pool)
    assert not pool.reserve("a", 2)  # only 1 available: refused, unchanged
    assert counters(pool) == before and pool.reserved("a") == 2
    with pytest.raises(ValueError):
        pool.reserve("a", 0, shared=[0])  # an existing owner cannot take shared blocks
    pool.free("a")
    assert counters(pool) == (6, 0, 6, 0, 0)


def test_free_is_idempotent():
    pool = BlockPool(num_blocks=4, block_size=2)
    assert pool.reserve("a", 2) and pool.allocate("a") == [0]
    pool.free("a")
    pool.free("a")  # cancel racing finish
    pool.free("never-seen")
    assert counters(pool) == (4, 0, 4, 0, 0) and list(pool.owners()) == []
    pool.check_invariants()


def test_cache_block_keeps_the_first_block_for_duplicate_content():
    pool = BlockPool(num_blocks=4, block_size=2)
    (h,) = hash_full_blocks([1, 2], 2, SALT)
    assert pool.reserve("a", 1) and pool.reserve("b", 1)
    assert pool.allocate("a") == [0] and pool.allocate("b") == [1]  # both computed [1, 2]
    pool.cache_block(0, h)
    pool.cache_block(1, h)  # duplicate: the existing mapping wins
    pool.cache_block(0, h)  # same pair again: no-op
    assert pool.blocks[1].block_hash is None and pool.lookup_prefix([h]) == [0]
    assert pool.num_cached == 1
    with pytest.raises(ValueError):
        pool.cache_block(0, h + 1)
    # Caching a block that is already free moves it from the fresh end to the MRU tail.
    pool.free("b")
    pool.cache_block(1, h + 1)
    assert pool.num_cached == 2
    assert pool.reserve("c", 3) and pool.allocate("c", 3) == [2, 3, 1]
    assert pool.num_cached == 1  # block 1 was evicted last
    pool.check_invariants()


def test_reset_prefix_cache_drops_only_unreferenced_blocks():
    pool = BlockPool(num_blocks=6, block_size=2)
    assert admit(pool, "a", [1, 2, 3, 4]) and admit(pool, "b", [5, 6])
    pool.free("a")
    assert pool.num_cached == 3
    assert pool.reset_prefix_cache() == 2
    assert pool.num_cached == 1 and pool.lookup_prefix(hash_full_blocks([5, 6], 2, SALT)) == [2]
    assert pool.lookup_prefix(hash_full_blocks([1, 2, 3, 4], 2, SALT)) == []
    pool.check_invariants()


def test_hash_chain_is_stable_and_depends_on_parent_and_salt():
    # Fixed values: any change to the hashing scheme breaks this (and every router's cached chains).
    assert hash_block_tokens(None, [1, 2, 3, 4], "tenant-a") == 11697959853709596901
    chain = hash_full_blocks(list(range(1, 9)), 4, "tenant-a")
    assert chain == [11697959853709596901, 16982414272776698365]
    assert chain[1] == hash_block_tokens(chain[0], [5, 6, 7, 8], "tenant-a")
    assert hash_block_tokens(None, [5, 6, 7, 8], "tenant-a") != chain[1]
    assert hash_block_tokens(chain[0] ^ 1, [5, 6, 7, 8], "tenant-a") != chain[1]
    assert hash_block_tokens(None, [1, 2, 3, 4], "tenant-b") != chain[0]
    # A chain can be continued from a parent: hashing in two pieces equals hashing at once.
    assert hash_full_blocks([5, 6, 7, 8], 4, "tenant-a", parent_hash=chain[0]) == chain[1:]


BASES = (list(range(100, 112)), list(range(200, 212)))


class BlockPoolMachine(RuleBasedStateMachine):
    """Random admissions (with and without prefix hits), allocation, caching, frees and resets.

    `free_order` models the free list (head first), so every allocation checks that fresh blocks go
    first, cached ones least-recently-freed first, and that free() releases tail blocks first.
    """

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4]))
    def make_pool(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.free_order = list(range(num_blocks))
        self.hashes: dict[str, list[int]] = {}  # owner -> hash chain of its prompt
        self.next_id = 0

    def _owners(self) -> list[str]:
        return sorted(self.pool.owners())

    def _draw_owner(self, data, pred=lambda owner: True) -> str:
        return data.draw(st.sampled_from([o for o in self._owners() if pred(o)]))

    @rule(base=st.sampled_from(BASES), length=st.integers(0, 12),
          tail=st.lists(st.integers(0, 1), max_size=1), salt=st.sampled_from(["t0", "t1"]),
          use_hits=st.booleans(), extra=st.integers(0, 2), compute=st.booleans())
    def reserve_new(self, base, length, tail, salt, use_hits, extra, compute) -> None:
        prompt = base[:length] + tail
        owner, self.next_id = f"r{self.next_id}", self.next_id + 1
        hashes = hash_full_blocks(prompt, self.pool.block_size, salt)
        hits = self.pool.lookup_prefix(hashes) if use_hits else []
        need = -(-len(prompt) // self.pool.block_size) - len(hits) + extra
        revived = [i for i in hits if self.pool.blocks[i].ref_count == 0]
        fits = need + len(revived) <= self.pool.num_available
        before = counters(self.pool)
        assert self.pool.reserve(owner, need, shared=hits) == fits
        if not fits:
            assert counters(self.pool) == before and owner not in self.pool.owners()
            return
        assert self.pool.block_table(owner) == hits and self.pool.reserved(owner) == need
        assert all(r >= 1 for r in refs(self.pool, hits))
        self.free_order = [i for i in self.free_order if i not in revived]
        self.hashes[owner] = hashes
        if compute and need > extra:  # prefill the whole prompt now and cache its full blocks
            self._allocate(owner, need - extra, cache=True)

    @precondition(lambda self: self._owners())
    @rule(data=st.data(), grow=st.integers(1, 3))
    def grow(self, data, grow) -> None:
        owner = self._draw_owner(data)
        fits = grow <= self.pool.num_available
        assert self.pool.reserve(owner, grow) == fits

    @precondition(lambda self: any(self.pool.reserved(o) for o in self._owners()))
    @rule(data=st.data(), cache=st.booleans())
    def allocate(self, data, cache) -> None:
        owner = self._draw_owner(data, self.pool.reserved)
        self._allocate(owner, data.draw(st.integers(1, self.pool.reserved(owner))), cache)

    def _allocate(self, owner: str, n: int, cache: bool) -> None:
        new_ids = self.pool.allocate(owner, n)  # inside the reservation: must never fail
        assert new_ids == self.free_order[:n]  # fresh first, then cached LRU first
        del self.free_order[:n]
        assert self.pool.block_table(owner)[-n:] == new_ids
        assert all(self.pool.blocks[i].block_hash is None for i in new_ids)
        assert refs(self.pool, new_ids) == [1] * n
        if cache:  # the scheduler caches each full block once its KV is computed
            for block_id, block_hash in zip(self.pool.block_table(owner), self.hashes[owner]):
                self.pool.cache_block(block_id, block_hash)
                assert self.pool.lookup_prefix([block_hash]) != []

    @precondition(lambda self: self._owners())
    @rule(data=st.data())
    def free(self, data) -> None:
        owner = self._draw_owner(data)
        table = list(self.pool.block_table(owner))
        ref_left = {i: self.pool.blocks[i].ref_count for i in table}
        self.pool.free(owner)
        self.pool.free(owner)  # idempotent
        for block_id in reversed(table):
            ref_left[block_id] -= 1
            if ref_left[block_id] == 0 and self.pool.blocks[block_id].block_hash is None:
                self.free_order.insert(0, block_id)
            elif ref_left[block_id] == 0:
                self.free_order.append(block_id)
        del self.hashes[owner]
        assert owner not in self.pool.owners()

    @rule(base=st.sampled_from(BASES), salt=st.sampled_from(["t0", "t1"]))
    def lookup(self, base, salt) -> None:
        before = counters(self.pool)
        hashes = hash_full_blocks(base, self.pool.block_size, salt)
        hits = self.pool.lookup_prefix(hashes)
        assert [self.pool.blocks[i].block_hash for i in hits] == hashes[:len(hits)]
        assert counters(self.pool) == before

    @rule()
    def reset(self) -> None:
        idle = sum(b.ref_count == 0 and b.block_hash is not None for b in self.pool.blocks)
        assert self.pool.reset_prefix_cache() == idle

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check_invariants()
        assert 0 <= pool.num_reserved <= pool.num_free <= pool.num_blocks
        assert pool.num_reserved == sum(pool.reserved(o) for o in pool.owners())
        assert sorted(self.free_order) == [b.block_id for b in pool.blocks if b.ref_count == 0]

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for owner in self._owners():
            self.pool.free(owner)
        self.pool.check_invariants()
        assert (self.pool.num_free, self.pool.num_reserved, self.pool.num_used) == (
            self.pool.num_blocks, 0, 0)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_block_pool_state_machine = BlockPoolMachine.TestCase
