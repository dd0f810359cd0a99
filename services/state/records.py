"""Signed registry records: a worker's or service's record in Redis is trusted only if the fleet
wrote it.

Threat: a process that can write to Redis (before it had a password, or one that learned it)
registers a worker at an address it serves, and the router sends it Reserve / Prefill calls: the
fleet token in their metadata and the prompts in their bodies. So every record carries an
HMAC-SHA256 over its kind, its id and its bytes, keyed by a key derived from the fleet token
(HMAC(token, "kvfleet-records")); a reader drops a record whose MAC is wrong, and one whose
addresses are outside the fleet's allowed networks (127.0.0.0/8 and ::1 by default,
`KVFLEET_ALLOWED_NETWORKS` a comma-separated list of CIDRs), logging it (at most once a minute per
record and reason) and counting it (`RecordSeal.rejected`, the router's
`kvfleet_redis_records_rejected` metric).

Stored value: `MAGIC` + 32-byte MAC + the serialized message. Under `--insecure-internal` with no
fleet token there is no key: the MAC is zeros and readers check only the networks.

What the MAC does not guard: freshness (a captured record can be written back while it is still
within its TTL; it names the fleet's own worker, which checks the token itself), and anything
not in a record (tenant quotas: services/state/fleet_state.py).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from services.protocol import env

log = logging.getLogger(__name__)

MAGIC = b"KVF1"
MAC_BYTES = 32
KEY_LABEL = b"kvfleet-records"
ENV_ALLOWED_NETWORKS = env.ALLOWED_NETWORKS.name
DEFAULT_ALLOWED_NETWORKS = ("127.0.0.0/8", "::1/128")
LOG_EVERY_S = 60.0
MAX_LOGGED = 4096          # distinct (kind, id, reason) remembered for rate limiting

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class RejectedRecord(ValueError):
    """A record the fleet did not write, or that points outside its networks. `reason`: a short
    label (metric), the message says more."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def record_key(token: str) -> bytes:
    """The records' MAC key, derived from the fleet token (never the token itself)."""
    return hmac.new(token.encode(), KEY_LABEL, hashlib.sha256).digest()


def parse_networks(spec: str) -> tuple[Network, ...]:
    """`"10.0.0.0/8, ::1"` -> networks; ValueError naming a bad one."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            out.append(ipaddress.ip_network(part, strict=False))
        except ValueError as e:
            raise ValueError(f"allowed network {part!r}: {e}") from None
    if not out:
        raise ValueError(f"no allowed network in {spec!r}")
    return tuple(out)


def networks_from_env(environ: Mapping[str, str] = os.environ) -> tuple[Network, ...]:
    return parse_networks(env.ALLOWED_NETWORKS.get(environ) or ",".join(DEFAULT_ALLOWED_NETWORKS))


def host_of(address: str) -> str:
    """The host of `host:port`, `[v6]:port` or a URL's netloc (`http://host:port/path`)."""
    rest = address.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def address_problem(address: str, allowed: Iterable[Network]) -> str | None:
    """None if `address`'s host is an IP literal in one of `allowed` (empty address: none)."""
    if not address:
        return None
    host = host_of(address)
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"address {address!r} is not an IP literal"
    if not any(ip in net for net in allowed):
        return f"address {address!r} is outside the allowed networks"
    return None


@dataclass
class RecordSeal:
    """Seals records on write, opens (checks) them on read. One per FleetState."""
    key: bytes | None = field(default=None, repr=False)
    allowed: tuple[Network, ...] = field(
        default_factory=lambda: parse_networks(",".join(DEFAULT_ALLOWED_NETWORKS)))
    on_rejected: Callable[[str, str], None] | None = None     # (kind, reason): a metric
    rejected: Counter = field(default_factory=Counter)          # (kind, reason) -> count
    _logged: dict = field(default_factory=dict, repr=False)     # (kind, id, reason) -> last log

    @classmethod
    def from_token(cls, token: str | None, environ: Mapping[str, str] = os.environ) -> RecordSeal:
        return cls(record_key(token) if token else None, networks_from_env(environ))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RecordSeal:
        """This process's: the fleet token it runs with (services/protocol/fleet_token.py)."""
        from services.protocol import fleet_token
        return cls.from_token(fleet_token.active().token, environ)

    def _mac(self, kind: str, record_id: str, payload: bytes) -> bytes:
        if self.key is None:
            return bytes(MAC_BYTES)
        message = b"\0".join((kind.encode(), record_id.encode(), payload))
        return hmac.new(self.key, message, hashlib.sha256).digest()

    def seal(self, kind: str, record_id: str, payload: bytes) -> bytes:
        return MAGIC + self._mac(kind, record_id, payload) + payload

    def open(self, kind: str, record_id: str, raw: bytes) -> bytes:
        """The payload of a sealed record, or RejectedRecord."""
        if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + MAC_BYTES:
            raise RejectedRecord("unsigned", "not a signed record")
        mac, payload = raw[len(MAGIC):len(MAGIC) + MAC_BYTES], raw[len(MAGIC) + MAC_BYTES:]
        if self.key is not None and not hmac.compare_digest(mac, self._mac(kind, record_id, payload)):
            raise RejectedRecord("bad_signature", "its signature does not match the fleet's key")
        return payload

    def check_addresses(self, *addresses: str) -> None:
        for address in addresses:
            problem = address_problem(address, self.allowed)
            if problem:
                raise RejectedRecord("address", problem)

    def reject(self, kind: str, record_id: str, error: RejectedRecord, now: float | None = None) -> None:
        """Count a rejected record, and log it unless the same was logged within LOG_EVERY_S."""
        self.rejected[(kind, error.reason)] += 1
        if self.on_rejected is not None:
            self.on_rejected(kind, error.reason)
        now = time.monotonic() if now is None else now
        last = self._logged.get((kind, record_id, error.reason))
        if last is None or now - last >= LOG_EVERY_S:
            if len(self._logged) > MAX_LOGGED:
                self._logged.clear()
            self._logged[(kind, record_id, error.reason)] = now
            log.warning("ignoring the %s record %r in Redis: %s (not written by this fleet?)",
                        kind, record_id, error)
