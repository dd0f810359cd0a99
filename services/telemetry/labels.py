"""Bounded label values: a tenant label may not grow the number of series without limit."""
from __future__ import annotations

import threading
from collections.abc import Iterable

OTHER = "other"
DEFAULT_TENANT_LABELS = 20


class TenantLabels:
    """The label value a tenant's series is kept under: its own name for at most `limit` tenants,
    "other" for the rest.

    Which tenants get a name: those the config names first (`known`, e.g. the gateway's API keys,
    in order), then the first ones seen, until `limit` names are handed out. A name, once given, is
    kept for the life of the process: a series never moves between labels, so counters stay
    monotonic. With more tenants than `limit`, the top N by traffic are the ones to list in
    `known` (Prometheus can still rank the named ones; "other" holds the long tail)."""

    def __init__(self, limit: int = DEFAULT_TENANT_LABELS, known: Iterable[str] = ()) -> None:
        if limit < 0:
            raise ValueError(f"tenant label limit must be >= 0, got {limit}")
        self.limit = limit
        self._named: set[str] = set()
        self._lock = threading.Lock()
        for tenant in known:
            self.label(tenant)

    def label(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        with self._lock:
            if tenant and tenant != OTHER and len(self._named) < self.limit:
                self._named.add(tenant)
                return tenant
        return OTHER

    @property
    def named(self) -> frozenset[str]:
        return frozenset(self._named)
