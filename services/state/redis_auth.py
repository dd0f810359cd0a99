"""Redis credentials: where a process finds the password of the fleet's Redis, and how they travel.

Threat: a process on the host that can reach Redis's port. Without a password it could read and
write the fleet's state (worker records, quotas). With one, only holders of the password can.

Where a process finds them (first match wins):
  the URL's own `redis://user:pass@host:port` (or `rediss://` for TLS),
  `KVFLEET_REDIS_PASSWORD`, `KVFLEET_REDIS_PASSWORD_FILE` (and `KVFLEET_REDIS_USERNAME`, else the
  default user).
`kvfleet up` makes a password for its embedded Redis (`generate`), or takes the credentials out of
`--redis-url`, and hands them to its children in their environment (`child_env`): never on a
command line, never in a log line or a repr (`redact` for a URL that is printed).
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit, urlunsplit

from services.protocol import env

ENV_PASSWORD = env.REDIS_PASSWORD.name
ENV_PASSWORD_FILE = env.REDIS_PASSWORD_FILE.name
ENV_USERNAME = env.REDIS_USERNAME.name


class RedisCredentialsError(ValueError):
    """A password that cannot be used (unreadable file, empty)."""


def generate() -> str:
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class RedisCredentials:
    """A Redis username (None: the default user) and password (None: no AUTH)."""
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> RedisCredentials:
        username = env.REDIS_USERNAME.get(environ) or None
        if env.REDIS_PASSWORD.get(environ):
            return cls(username, env.REDIS_PASSWORD.get(environ))
        if env.REDIS_PASSWORD_FILE.get(environ):
            return cls(username, _read_file(env.REDIS_PASSWORD_FILE.get(environ)))
        return cls(username, None)

    def client_kwargs(self) -> dict[str, str]:
        """redis-py's `username`/`password` arguments. Given to `Redis.from_url`, the URL's own
        credentials win over them."""
        out = {}
        if self.username:
            out["username"] = self.username
        if self.password:
            out["password"] = self.password
        return out

    def env(self) -> dict[str, str]:
        """The variables that give a child process these credentials."""
        out = {ENV_PASSWORD: self.password} if self.password else {}
        if self.username:
            out[ENV_USERNAME] = self.username
        return out


def _read_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            password = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise RedisCredentialsError(f"cannot read the Redis password file {path}: {e}") from None
    if not password:
        raise RedisCredentialsError(f"the Redis password file {path} is empty")
    return password


def split_url(url: str) -> tuple[str, RedisCredentials]:
    """The URL without its `user:pass@`, and those credentials (None where the URL has none)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, RedisCredentials()
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    bare = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    return bare, RedisCredentials(username, password)


def redact(url: str) -> str:
    """The URL as it may be printed: a password in it is replaced by `***`."""
    bare, creds = split_url(url)
    if creds.password is None and creds.username is None:
        return url
    parts = urlsplit(bare)
    user = f"{creds.username or ''}:***@" if creds.password else f"{creds.username}@"
    return urlunsplit((parts.scheme, user + parts.netloc, parts.path, parts.query, parts.fragment))


def child_env(redis_url: str, environ: Mapping[str, str] = os.environ) -> tuple[str, dict[str, str]]:
    """For a parent that starts the fleet's processes: the URL to put on their command lines (no
    credentials in it) and the variables that carry the credentials (the URL's, else this
    process's own)."""
    bare, creds = split_url(redis_url)
    if creds.password is None and creds.username is None:
        creds = RedisCredentials.from_env(environ)
    return bare, creds.env()
