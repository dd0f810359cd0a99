"""Who gets the prefill part of the token budget: class priority with aging, then tenants by
weighted deficit round-robin (DRR) within a class, and the document share cap.

Pure helpers; the scheduler calls them and owns all state changes.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from services.engine.config import TrafficClass


T = TypeVar("T")


def priority_slot(queue: Sequence[T], priority: int, rank: Callable[[T], int | None]) -> int:
    """Where a request of vLLM `priority` (lower first) joins a class/tenant queue: behind every
    waiting request of the same or a lower value (ties FCFS) and behind every request whose
    rank is None (admitted, mid-prefill: it keeps its place). Scans from the back, so a queue of
    equal priorities costs O(1)."""
    i = len(queue)
    while i > 0 and (r := rank(queue[i - 1])) is not None and r > priority:
        i -= 1
    return i


def effective_priority(cls: TrafficClass, waited_s: float) -> float:
    """Class priority plus one level per `aging_s` waited: nothing starves."""
    return cls.priority + max(0.0, waited_s) / cls.aging_s


def class_budget(cls: TrafficClass, remaining: int, token_budget: int,
                 interactive_waits: bool) -> int:
    """Tokens this class may take now. While interactive work waits, a capped class (documents,
    batch) gets at most `share_while_interactive_waits` of the whole budget B."""
    if not interactive_waits or cls.share_while_interactive_waits >= 1.0:
        return remaining
    cap = int(cls.share_while_interactive_waits * token_budget)
    return max(0, min(remaining, cap))


def capped_base(role: str, token_budget: int, chunk_size: int) -> int:
    """The tokens a capped class's share (`class_budget`'s B) is of: the token budget; on a
    prefill worker two chunks. Its budget there is wide for throughput, and a document filling it
    stretches every step the chats wait through, while each of those chats holds a decode seat
    reserved on another worker, empty until its KV lands. (The router's step-ahead uses it too.)"""
    if role == "prefill":
        return min(token_budget, 2 * chunk_size)
    return token_budget


def drr_others_ahead(own: int, tenant: str, queued: Mapping[str, int],
                     weights: Mapping[str, float]) -> int:
    """Prefill tokens of the other tenants of a class that weighted DRR serves before a request of
    `tenant` that has `own` of its tenant's tokens ahead of it: of each other tenant u, at most
    weight_u / weight_tenant times `own` (u's queue if smaller). A tenant without a weight counts
    as 1. So a quiet tenant's first request is next in line however long a flood's queue is."""
    mine = weights.get(tenant, 1.0)
    return int(sum(min(tokens, weights.get(t, 1.0) / mine * own)
                   for t, tokens in queued.items() if t != tenant))


class DeficitRoundRobin:
    """Weighted DRR over the tenants of one class, in prefill tokens.

    Tenants sit on a ring. A tenant whose turn begins is credited `quantum * weight` tokens of
    deficit and may spend them on chunks; its turn ends when the deficit is spent, its schedulable
    work runs out, or the iteration's budget is gone, in which case the next iteration resumes with
    the same tenant. A tenant with no queued work loses its leftover deficit (classic DRR), so idle
    tenants cannot bank credit. Over many iterations tenant shares converge to their weights.
    """

    def __init__(self, quantum: int) -> None:
        self.quantum = quantum
        self.ring: list[str] = []
        self.cursor = 0
        self.deficit: dict[str, float] = {}

    def serve(self, tenants: dict[str, float], budget: int,
              take: Callable[[str, int], int]) -> int:
        """Spend up to `budget` tokens over `tenants` (name -> weight, those with queued work).
        `take(tenant, max_tokens)` schedules up to that many tokens of the tenant's work and returns
        how many it used (0 = blocked by capacity or caps). Returns the tokens used."""
        self._sync(tenants)
        done: set[str] = set()
        used_total = 0
        while budget > 0 and len(done) < len(tenants):
            tenant = self.ring[self.cursor]
            if tenant not in tenants or tenant in done:
                self._advance()
                continue
            if self.deficit[tenant] <= 0:
                self.deficit[tenant] += max(1.0, self.quantum * tenants[tenant])
            allowed = min(budget, int(self.deficit[tenant]) or 1)
            used = take(tenant, allowed)
            budget -= used
            used_total += used
            self.deficit[tenant] -= used
            if used < allowed:            # ran out of schedulable work for this iteration
                done.add(tenant)
                self._advance()
            elif self.deficit[tenant] <= 0:  # turn over
                self._advance()
        return used_total

    def _sync(self, tenants: Iterable[str]) -> None:
        for t in tenants:
            if t not in self.deficit:
                self.ring.append(t)
                self.deficit[t] = 0.0
        for t in self.ring:
            if t not in tenants:
                self.deficit[t] = 0.0     # no queued work: no banked credit

    def _advance(self) -> None:
        self.cursor = (self.cursor + 1) % len(self.ring)
