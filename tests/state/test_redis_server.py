"""The two Redis servers kvfleet can start: each answers PING and Lua, and leaves nothing behind."""
from __future__ import annotations

import socket
import threading

import pytest
import redis

from services.state.redis_server import (EmbeddedRedis, RedisNotInstalledError, RedisServerProcess,
                                          free_port)

INCR_LUA = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def check_lua(url: str) -> None:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        assert client.ping()
        assert client.eval(INCR_LUA, 1, "lua-check", 5) == 5   # EVAL
        script = client.register_script(INCR_LUA)
        assert script(keys=["lua-check"], args=[2]) == 7          # EVALSHA
        assert client.evalsha(script.sha, 1, "lua-check", 1) == 8
    finally:
        client.close()


def test_free_port_is_bindable_on_loopback():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_embedded_redis_serves_lua_and_stops_its_threads():
    threads_before = set(threading.enumerate())
    server = EmbeddedRedis().start()
    assert server.url == f"redis://127.0.0.1:{server.port}/0" and server.running
    check_lua(server.url)

    server.stop()
    server.stop()  # idempotent
    assert not server.running and not port_open(server.port)
    assert set(threading.enumerate()) <= threads_before


def test_embedded_redis_context_manager_on_a_chosen_port():
    port = free_port()
    with EmbeddedRedis(port=port) as server:
        assert server.port == port and redis.Redis(port=port).ping()
    assert not port_open(port)


def test_redis_server_process_serves_lua_and_leaves_nothing():
    with RedisServerProcess() as server:
        proc, data_dir, port = server.process, server.dir, server.port
        assert proc.poll() is None and data_dir.is_dir()
        assert server.url == f"redis://127.0.0.1:{port}/0"
        check_lua(server.url)
        client = redis.Redis.from_url(server.url, decode_responses=True)
        assert client.config_get("bind") == {"bind": "127.0.0.1"}
        assert client.config_get("save") == {"save": ""}
        client.close()
    assert proc.poll() is not None
    assert not port_open(port) and not data_dir.exists()
    server.stop()  # idempotent


def test_redis_server_process_missing_binary_is_a_clear_error():
    with pytest.raises(RedisNotInstalledError, match="not found on PATH"):
        RedisServerProcess(executable="kvfleet-no-such-redis-server").start()
