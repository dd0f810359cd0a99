"""Paged-KV block pool: ref counts, reservations and a tenant-salted prefix cache (torch-free).

The scheduler is the only caller; an *owner* is a request id. The pool is the single source of
truth for every owner's block table and reservation. Every operation is O(1) per block touched.
"""
from __future__ import annotations

import gc
import hashlib
import struct
from collections.abc import Iterable, Sequence

_PERSON = b"kvfleet.kvblock1"  # blake2b personalisation (16 bytes); change it to change the scheme


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], salt: str) -> int:
    """64-bit hash of one full block, chained on its parent's hash and salted by tenant.

    blake2b over (parent, salt, tokens as int64), so it is the same in every process and Python
    run (unlike builtin hash()): a router elsewhere can compute the same chain from the tokens.
    """
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    h.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(8, "little"))
    salt_bytes = salt.encode()
    h.update(len(salt_bytes).to_bytes(4, "little") + salt_bytes)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, salt: str, parent_hash: int | None = None
) -> list[int]:
    """The hash chain over the full blocks of token_ids; a partial tail block gets no hash."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start:start + block_size], salt)
        hashes.append(parent_hash)
    return hashes


def usable_prefix_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt a prefix-cache hit may cover: at least one token is always left to
    compute (its logits are needed). The scheduler's lookup and the router's prefix index agree
    through this."""
    return max(0, (num_tokens - 1) // block_size)


class KVEventLog:
    """What changed in the prefix cache since the last `take`, for the worker to publish (the
    router's prefix index follows it). Net state per hash, last change wins: a hash stored then
    evicted within one batch is one eviction. Bounded: past `max_entries` distinct hashes the log
    drops them and says `overflowed` (the reader sends a full snapshot instead)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._changes: dict[int, bool] = {}    # hash -> held now (stored) / not (evicted)
        self.overflowed = False

    def record(self, block_hash: int, held: bool) -> None:
        if self.overflowed:
            return
        self._changes[block_hash] = held
        if len(self._changes) > self.max_entries:
            self._changes.clear()
            self.overflowed = True

    def take(self) -> tuple[list[int], list[int], bool]:
        """(stored, evicted, overflowed) since the last take; the log starts over."""
        stored = [h for h, held in self._changes.items() if held]
        evicted = [h for h, held in self._changes.items() if not held]
        overflowed, self.overflowed = self.overflowed, False
        self._changes = {}
        return stored, evicted, overflowed


class KVBlock:
    """One page of block_size token slots. The free-list links belong to BlockPool."""

    __slots__ = ("block_id", "ref_count", "block_hash", "_prev_free", "_next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self._prev_free: KVBlock | None = None  # both None while the block is in use
        self._next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class BlockPool:
    """Fixed pool of num_blocks pages with per-owner block tables and reservations.

    Free list: intrusive, doubly linked, with sentinels; allocation pops the head.

        HEAD <-> [uncached] ... [uncached] <-> [cached LRU] ... [cached MRU] <-> TAIL
                 ^ fresh pages, taken first     ^ evicted next   ^ most recently freed

    A block reaching ref 0 goes to the head if uncached, to the tail if cached: fresh pages are
    used before any cached page is evicted, and cached pages go least-recently-freed first.

    Invariants (check_invariants):
      - num_free >= num_reserved, so allocating inside a reservation can never fail;
      - block.ref_count == number of owner block-table entries naming the block;
      - a block is on the free list iff ref_count == 0; uncached free blocks precede cached ones;
      - hash map and block_hash agree both ways: map[h] is b iff b.block_hash == h.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._head, self._tail = KVBlock(-1), KVBlock(-1)
        self._head._next_free, self._tail._prev_free = self._tail, self._head
        self._num_free = 0
        # A 70B target's pool is ~160K blocks, all kept: the cyclic collector's passes over the
        # objects alive meanwhile (they grow with every pool a simulated fleet holds) would cost
        # more than making the blocks, so it waits until they are made and linked.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.blocks = [KVBlock(i) for i in range(num_blocks)]
            for block in self.blocks:
                self._push_tail(block)
        finally:
            if collecting:
                gc.enable()
        self._num_reserved = 0
        self._tables: dict[str, list[int]] = {}
        self._reserved: dict[str, int] = {}
        self._hash_to_block: dict[int, KVBlock] = {}
        self.events = KVEventLog(max_entries=2 * num_blocks)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_reserved(self) -> int:
        return self._num_reserved

    @property
    def num_available(self) -> int:
        return self._num_free - self._num_reserved

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_cached(self) -> int:
        return len(self._hash_to_block)

    def cached_hashes(self) -> list[int]:
        """Every hash in the prefix cache now (a full snapshot for the router's index)."""
        return list(self._hash_to_block)

    def block_table(self, owner: str) -> list[int]:
        """The owner's block ids in position order, shared prefix first. Read-only (not a copy)."""
        return self._tables.get(owner, [])

    def reserved(self, owner: str) -> int:
        return self._reserved.get(owner, 0)

    def held(self, owner: str) -> int:
        return len(self.block_table(owner))

    def owners(self) -> Iterable[str]:
        return self._tables.keys()

    def reserve(self, owner: str, num_new_blocks: int, shared: Sequence[int] = ()) -> bool:
        """Atomically acquire the `shared` prefix blocks and reserve num_new_blocks more."""
        if num_new_blocks < 0:
            raise ValueError("num_new_blocks must be >= 0")
        if shared and owner in self._tables:
            raise ValueError(f"owner {owner!r} exists: only a new owner takes shared blocks")
        blocks = [self.blocks[i] for i in shared]
        if any(b.block_hash is None for b in blocks):
            raise ValueError("shared blocks must be in the prefix cache (use lookup_prefix)")
        revived = len({b.block_id for b in blocks if b.ref_count == 0})
        if num_new_blocks + revived > self.num_available:
            return False
        table = self._tables.setdefault(owner, [])
        for block in blocks:
            self._incref(block)
            table.append(block.block_id)
        self._reserved[owner] = self._reserved.get(owner, 0) + num_new_blocks
        self._num_reserved += num_new_blocks
        return True

    def allocate(self, owner: str, n: int = 1) -> list[int]:
        """Take n fresh blocks out of the owner's reservation (never fails within it)."""
        if owner not in self._tables or not 0 <= n <= self._reserved[owner]:
            raise ValueError(f"allocate({owner!r}, {n}): reservation is {self.reserved(owner)}")
        new_ids = [self._pop_free().block_id for _ in range(n)]
        self._tables[owner].extend(new_ids)
        self._reserved[owner] -= n
        self._num_reserved -= n
        return new_ids

    def free(self, owner: str) -> None:
        """End the owner: decref its blocks tail-first, drop its reservation. Unknown: no-op."""
        table = self._tables.pop(owner, None)
        if table is None:
            return
        self._num_reserved -= self._reserved.pop(owner)
        for block_id in reversed(table):
            self._decref(self.blocks[block_id])

    def fork(self, parent: str, child: str, num_tokens: int, reserve: int) -> tuple[int, int] | None:
        """Start `child` as a copy-on-write sample of the parent's first num_tokens tokens (n > 1).

            parent: [b0][b1][t ]          b0, b1 full: shared, ref count +1 each
            child:  [b0][b1][t']          t partial: the child gets a fresh t' (copy t -> t')

        `reserve` blocks move from the parent's reservation to the child's (the pool's total
        reservation is unchanged); t' is taken from them. Returns (t, t') for the caller to copy
        the KV, or None when num_tokens ends on a block boundary."""
        table = self._tables.get(parent)
        full, partial = divmod(num_tokens, self.block_size)
        if table is None or child in self._tables or len(table) < full + (partial > 0):
            raise ValueError(f"fork({parent!r} -> {child!r}): parent unknown, child exists, "
                             f"or the parent holds fewer than {num_tokens} tokens' blocks")
        if not (1 if partial else 0) <= reserve <= self._reserved[parent]:
            raise ValueError(f"fork({parent!r} -> {child!r}, reserve={reserve}): the parent's "
                             f"reservation is {self._reserved[parent]}")
        self._reserved[parent] -= reserve
        self._reserved[child] = reserve
        shared = table[:full]
        for block_id in shared:
            self._incref(self.blocks[block_id])
        self._tables[child] = list(shared)
        if not partial:
            return None
        return table[full], self.allocate(child, 1)[0]

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Register a full, computed block. A hash already mapped elsewhere keeps its mapping."""
        block = self.blocks[block_id]
        if block.block_hash == block_hash:
            return
        if block.block_hash is not None:
            raise ValueError(f"block {block_id} is already cached under another hash")
        if block_hash in self._hash_to_block:
            return  # duplicate content: keep the existing block, this one stays uncached
        block.block_hash = block_hash
        self._hash_to_block[block_hash] = block
        self.events.record(block_hash, True)
        if block.ref_count == 0:  # free and uncached until now: it moves to the MRU tail
            self._unlink(block)
            self._push_tail(block)

    def lookup_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of block_hashes (pure)."""
        hits: list[int] = []
        for block_hash in block_hashes:
            block = self._hash_to_block.get(block_hash)
            if block is None:
                break
            hits.append(block.block_id)
        return hits

    def reset_prefix_cache(self) -> int:
        """Drop the hashes of all unreferenced cached blocks; returns how many were dropped."""
        idle = [h for h, b in self._hash_to_block.items() if b.ref_count == 0]
        for block_hash in idle:
            self._hash_to_block.pop(block_hash).block_hash = None
            self.events.record(block_hash, False)
        return len(idle)  # no cached block is left on the free list, so its order still holds

    def _incref(self, block: KVBlock) -> None:
        if block.ref_count == 0:
            self._unlink(block)
        block.ref_count += 1

    def _decref(self, block: KVBlock) -> None:
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if block.block_hash is None:
            self._insert_after(self._head, block)
        else:
            self._push_tail(block)

    def _pop_free(self) -> KVBlock:
        block = self._head._next_free
        assert block is not None and block is not self._tail, "free list empty"
        self._unlink(block)
        if block.block_hash is not None:  # evict: the page is about to be overwritten
            del self._hash_to_block[block.block_hash]
            self.events.record(block.block_hash, False)
            block.block_hash = None
        block.ref_count = 1
        return block

    def _unlink(self, block: KVBlock) -> None:
        prev, nxt = block._prev_free, block._next_free
        assert prev is not None and nxt is not None, f"{block} is not free"
        prev._next_free, nxt._prev_free = nxt, prev
        block._prev_free = block._next_free = None
        self._num_free -= 1

    def _insert_after(self, prev: KVBlock, block: KVBlock) -> None:
        nxt = prev._next_free
        assert nxt is not None
        block._prev_free, block._next_free = prev, nxt
        prev._next_free = nxt._prev_free = block
        self._num_free += 1

    def _push_tail(self, block: KVBlock) -> None:
        assert self._tail._prev_free is not None
        self._insert_after(self._tail._prev_free, block)

    def check_invariants(self) -> None:
        """O(num_blocks) self-check; raises AssertionError on any violation."""
        free_ids = self._check_free_list()
        refs = [0] * self.num_blocks
        for table in self._tables.values():
            for block_id in table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"{block}: {refs[block.block_id]} refs"
            assert (block.block_id in free_ids) == (block.ref_count == 0), f"{block} free state"
            if block.block_hash is not None:
                assert self._hash_to_block.get(block.block_hash) is block, f"{block} not mapped"
        for block_hash, block in self._hash_to_block.items():
            assert block.block_hash == block_hash, f"map entry {block_hash} -> {block}"
        assert self._tables.keys() == self._reserved.keys(), "tables and reservations disagree"
        assert min(self._reserved.values(), default=0) >= 0, "negative reservation"
        assert self._num_reserved == sum(self._reserved.values()), "num_reserved drifted"
        assert self._num_free >= self._num_reserved, "reservations overcommit the free blocks"

    def _check_free_list(self) -> set[int]:
        ids: set[int] = set()
        seen_cached = False
        node = self._head
        while node._next_free is not self._tail:
            nxt = node._next_free
            assert nxt is not None and nxt._prev_free is node, "broken free-list link"
            assert nxt.block_id not in ids, "free-list cycle"
            assert not (seen_cached and nxt.block_hash is None), "uncached after a cached block"
            seen_cached = seen_cached or nxt.block_hash is not None
            ids.add(nxt.block_id)
            node = nxt
        assert self._tail._prev_free is node, "broken free-list tail"
        assert len(ids) == self._num_free, f"free list holds {len(ids)}, counter {self._num_free}"
        return ids
