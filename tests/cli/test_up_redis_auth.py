"""`kvfleet up` and Redis's password, as a user runs it: with the embedded Redis it makes a
password (written to a 0600 file the banner names, never printed), its children authenticate
with it from their environment, and a client without it is refused; with `--redis-url
redis://:pass@host:port` the credentials reach the children by environment, not on their command
lines. Either way the fleet serves."""
from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.cli.launcher import descendants
from services.state import redis_auth
from tests.harness import up_fleet


ONCE = Retry(NoBackoff(), 0)


def serves(url: str) -> None:
    name = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": name, "prompt": "Hello fleet", "max_tokens": 2})
    assert r.status_code == 200, r.text


def command_lines(pids: list[int]) -> list[bytes]:
    out = []
    for p in pids:
        try:
            out.append(Path(f"/proc/{p}/cmdline").read_bytes())
        except OSError:
            pass                                   # gone meanwhile
    return out


def banner_value(lines: list[str], name: str) -> str:
    return next(line.split(None, 1)[1] for line in lines if line.split()[:1] == [name])


def test_the_embedded_redis_gets_a_generated_password_its_children_use(tiny_model_dir):
    # no password in up's environment: it makes one
    with up_fleet(tiny_model_dir, mode="colocated", env={redis_auth.ENV_PASSWORD: ""}) as up:
        proc, lines = up.proc, up.lines
        url = banner_value(lines, "redis")
        origin = banner_value(lines, "redis-auth")
        path = re.search(r"generated, in (\S+) ", origin).group(1)
        password = Path(path).read_text().strip()
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert password not in "\n".join(lines)
        assert not any(password.encode() in c
                       for c in command_lines([proc.pid, *descendants(proc.pid)]))
        serves(up.url)

        # (asked once: redis-py retries a refused AUTH with backoff, ~3 s, for the same answer)
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(url, retry=ONCE).get("kvfleet:workers")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url, password="guess", retry=ONCE).get("kvfleet:workers")
        client = redis.Redis.from_url(url, password=password)
        assert client.smembers("kvfleet:workers") == {b"mixed-0"}
        client.close()


def test_redis_url_credentials_reach_the_children_by_environment(tiny_model_dir, redis_url):
    """The session's redis-server requires a password; its URL carries it."""
    bare, creds = redis_auth.split_url(redis_url)
    assert creds.password
    db_url = bare.rsplit("/", 1)[0] + "/9"
    with_credentials = db_url.replace("redis://", f"redis://:{creds.password}@", 1)
    with up_fleet(tiny_model_dir, mode="colocated", redis_url=with_credentials,
                    env={redis_auth.ENV_PASSWORD: ""}) as up:
        proc, lines = up.proc, up.lines
        assert banner_value(lines, "redis") == db_url
        # (up's own command line has them: the test gave them there)
        children = [c for c in command_lines(descendants(proc.pid)) if b"--redis-url" in c]
        assert children and all(creds.password.encode() not in c for c in children)
        serves(up.url)
    client = redis.Redis.from_url(with_credentials)
    client.flushdb()
    client.close()
