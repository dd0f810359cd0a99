"""Redis requires a password: both servers kvfleet starts refuse a client without it (or with a
wrong one) and serve one with it, the password never on a command line; credentials travel from a
URL or the environment (services/state/redis_auth.py); TLS (`rediss://`) to a real redis-server
with a self-signed certificate."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.state import redis_auth
from services.state.fleet_state import FleetState
from services.state.redis_auth import RedisCredentials, RedisCredentialsError
from tests.waiting import wait_until
from services.state.redis_server import (HOST, EmbeddedRedis, RedisServerProcess,
                                          _die_with_parent_hook, free_port)

PASSWORD = 'a "pass" word\\with spaces'


@pytest.fixture(params=["embedded", "redis-server"])
def server(request):
    kind = EmbeddedRedis if request.param == "embedded" else RedisServerProcess
    with kind(password=PASSWORD) as s:
        yield s


# redis-py retries a refused AUTH as a connection error, with backoff (~3 s a refusal): the
# refusal is the server's first answer, so these clients ask once.
ONCE = Retry(NoBackoff(), 0)


def get(port: int, **credentials) -> str:
    client = redis.Redis(host=HOST, port=port, decode_responses=True, retry=ONCE, **credentials)
    try:
        client.set("k", "v")
        return client.get("k")
    finally:
        client.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_client_without_the_password_is_refused_and_one_with_it_served(server, protocol):
    # RESP2 clients AUTH, RESP3 ones (redis-py's default from 8) authenticate in HELLO
    for credentials in ({}, {"password": "wrong"}, {"username": "default", "password": "wrong"},
                        {"username": "kvfleet-unauthenticated", "password": ""}):
        with pytest.raises((redis.AuthenticationError, redis.exceptions.NoPermissionError)):
            get(server.port, protocol=protocol, **credentials)
    assert get(server.port, protocol=protocol, password=PASSWORD) == "v"
    assert get(server.port, protocol=protocol, username="default", password=PASSWORD) == "v"
    assert redis.Redis.from_url(server.auth_url).get("k") == b"v"


def test_the_password_is_not_on_redis_servers_command_line():
    with RedisServerProcess(password=PASSWORD) as s:
        cmdline = Path(f"/proc/{s.process.pid}/cmdline").read_bytes()
        assert b"pass" not in cmdline
        assert oct((s.dir / "redis.conf").stat().st_mode & 0o777) == "0o600"


def test_fleet_state_takes_the_password_from_the_url_or_the_environment(server, monkeypatch):
    async def ping(url: str, **kw) -> None:
        async with FleetState(url, **kw) as fs:
            await fs.ping()

    asyncio.run(ping(server.auth_url))
    asyncio.run(ping(server.url, credentials=RedisCredentials(password=PASSWORD)))
    monkeypatch.setenv(redis_auth.ENV_PASSWORD, PASSWORD)
    asyncio.run(ping(server.url))
    monkeypatch.setenv(redis_auth.ENV_PASSWORD, "wrong")
    with pytest.raises(redis.AuthenticationError):
        asyncio.run(ping(server.url))
    asyncio.run(ping(server.auth_url))                      # the URL's own wins


def test_credentials_from_a_password_file(tmp_path):
    path = tmp_path / "pw"
    path.write_text("s3cret\n")
    assert RedisCredentials.from_env({redis_auth.ENV_PASSWORD_FILE: str(path)}).password == "s3cret"
    with pytest.raises(RedisCredentialsError, match="cannot read"):
        RedisCredentials.from_env({redis_auth.ENV_PASSWORD_FILE: str(tmp_path / "missing")})
    path.write_text("\n")
    with pytest.raises(RedisCredentialsError, match="empty"):
        RedisCredentials.from_env({redis_auth.ENV_PASSWORD_FILE: str(path)})
    assert "s3cret" not in repr(RedisCredentials("u", "s3cret"))


def test_a_url_with_credentials_is_split_for_a_childs_command_line_and_environment():
    bare, env = redis_auth.child_env("redis://alice:p%40ss@127.0.0.1:6390/2", environ={})
    assert bare == "redis://127.0.0.1:6390/2"
    assert env == {redis_auth.ENV_PASSWORD: "p@ss", redis_auth.ENV_USERNAME: "alice"}
    bare, env = redis_auth.child_env("rediss://:pw@[::1]:6390/0", environ={})
    assert (bare, env) == ("rediss://[::1]:6390/0", {redis_auth.ENV_PASSWORD: "pw"})
    # no credentials in the URL: this process's own pass on
    assert redis_auth.child_env("redis://127.0.0.1:1/0", {redis_auth.ENV_PASSWORD: "x"}) == (
        "redis://127.0.0.1:1/0", {redis_auth.ENV_PASSWORD: "x"})
    assert redis_auth.redact("redis://alice:p%40ss@127.0.0.1:6390/2") == \
        "redis://alice:***@127.0.0.1:6390/2"


# --- TLS ----------------------------------------------------------------------------------------

def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (and its key), valid for a day, made by openssl."""
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                    "/CN=kvfleet-test", "-addext", f"subjectAltName=IP:{HOST}",
                    "-keyout", str(key_path), "-out", str(cert_path)],
                   check=True, capture_output=True, timeout=30)
    return cert_path, key_path


def test_fleet_state_speaks_tls_to_a_real_redis_server_with_a_password():
    directory = Path(tempfile.mkdtemp(prefix="kvfleet-redis-tls-"))
    port, password = free_port(), redis_auth.generate()
    cert, key = self_signed(directory)
    config = "\n".join([f"bind {HOST}", "port 0", f"tls-port {port}", f'dir "{directory}"',
                        f"tls-cert-file {cert}", f"tls-key-file {key}", f"tls-ca-cert-file {cert}",
                        "tls-auth-clients no", 'save ""', "appendonly no",
                        f"requirepass {password}", ""])
    proc = subprocess.Popen([shutil.which("redis-server"), "-"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=_die_with_parent_hook())
    proc.stdin.write(config)
    proc.stdin.close()
    url = f"rediss://{HOST}:{port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
    try:
        def up() -> bool:
            client = redis.Redis.from_url(url, password=password, socket_timeout=0.5)
            try:
                return bool(client.ping())
            except (redis.ConnectionError, redis.TimeoutError, OSError):
                return False
            finally:
                client.close()
        assert wait_until(up, 10.0), "no TLS redis-server"

        async def round_trip() -> int:
            async with FleetState(url, credentials=RedisCredentials(password=password)) as fs:
                return await fs.streams("t")
        assert asyncio.run(round_trip()) == 0
        # the same port without TLS, or TLS without the password, gets nothing
        with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
            redis.Redis(host=HOST, port=port, password=password, socket_timeout=1,
                        retry=ONCE).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url, socket_timeout=1, retry=ONCE).ping()
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(directory, ignore_errors=True)
