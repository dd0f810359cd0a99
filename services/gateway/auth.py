"""API key -> (tenant, traffic class, limits). Keys are looked up by their SHA-256, so a lookup's
timing says nothing about how much of a guessed key was right."""
from __future__ import annotations

import hashlib
import hmac

from services.gateway.config import ANONYMOUS_KEY, ApiKey
from services.gateway.errors import unauthorized


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def bearer_token(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` value; 401 when there is none."""
    if not authorization:
        raise unauthorized("missing API key: send `Authorization: Bearer <key>`")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthorized("malformed Authorization header: expected `Bearer <key>`")
    return token.strip()


def check_metrics_key(expected: str | None, authorization: str | None) -> None:
    """/metrics with a metrics key: only `Bearer <that key>` (compared in constant time)."""
    if expected is None:
        return
    if not hmac.compare_digest(_digest(bearer_token(authorization)), _digest(expected.strip())):
        raise unauthorized("incorrect metrics key provided")


def key_id(key: ApiKey) -> str:
    """What names a key outside this process (an asynchronous job's record): its SHA-256, hex."""
    return _digest(key.key).hex()


class KeyRing:
    """`keys` None: every caller is the anonymous tenant (only allowed on loopback or --insecure)."""

    def __init__(self, keys: tuple[ApiKey, ...] | None, anonymous: ApiKey = ANONYMOUS_KEY) -> None:
        self._by_digest = None if keys is None else {_digest(k.key): k for k in keys}
        self._anonymous = anonymous

    def ids(self) -> list[str]:
        """The `key_id` of every key this gateway has (the anonymous one's when it has none)."""
        if self._by_digest is None:
            return [key_id(self._anonymous)]
        return [d.hex() for d in self._by_digest]

    def find(self, kid: str) -> ApiKey | None:
        """The key whose `key_id` is `kid`, if this gateway still has it."""
        if self._by_digest is None:
            return self._anonymous if kid == key_id(self._anonymous) else None
        return next((k for d, k in self._by_digest.items() if d.hex() == kid), None)

    @property
    def required(self) -> bool:
        return self._by_digest is not None

    def authenticate(self, authorization: str | None) -> ApiKey:
        """`authorization` is the header / metadata value, e.g. "Bearer sk-..."."""
        if self._by_digest is None:
            return self._anonymous
        key = self._by_digest.get(_digest(bearer_token(authorization)))
        if key is None:
            raise unauthorized("incorrect API key provided")
        return key
