"""A real fleet for gateway tests: redis-server, router, one mixed worker and the gateway, all
processes on 127.0.0.1, started and stopped by one Launcher (via `running_fleet`).

The worker and the gateway read the same engine config (`ENGINE_CONFIG`): the tenants the API keys
name, a 4096-token context and an interactive class capped at 2048 prompt tokens, so the length
limits are cheap to reach.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx
import yaml

from services.cli.launcher import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from tests.fleet.fleet_helpers import Fleet

CONTEXT = 4096
INTERACTIVE_MAX_PROMPT = 2048
_CLASS_DEFAULTS = dict(ttft_target_s=10.0, itl_target_s=1.0, output_cap=2048,
                       predicted_output_tokens=256, aging_s=10.0)
ENGINE_CONFIG = {
    "max_model_len": CONTEXT,
    "scheduler": {
        "classes": [
            {"name": "interactive", "priority": 2, "max_prompt_tokens": INTERACTIVE_MAX_PROMPT,
             **_CLASS_DEFAULTS},
            {"name": "document", "priority": 1, "max_prompt_tokens": 131072, **_CLASS_DEFAULTS},
            {"name": "batch", "priority": 0, "max_prompt_tokens": 131072, **_CLASS_DEFAULTS},
        ],
        "tenants": [{"name": t} for t in ("default", "acme", "solo", "metered", "frugal", "leaver")],
    },
}


def key(secret: str, tenant: str, traffic_class: str = "interactive", streams: int = 64,
        rpm: int = 100_000, tpm: int = 10_000_000) -> dict:
    return {"key": secret, "tenant": tenant, "traffic_class": traffic_class,
            "max_concurrent_streams": streams, "requests_per_minute": rpm, "tokens_per_minute": tpm}


KEYS = {
    "acme": key("sk-acme-0001", "acme"),
    "doc": key("sk-acme-doc-0002", "acme", "document"),
    "solo": key("sk-solo-0003", "solo", streams=1),
    "metered": key("sk-metered-0004", "metered", rpm=2),
    "frugal": key("sk-frugal-0007", "frugal", tpm=40),
    "leaver": key("sk-leaver-0005", "leaver"),
}


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]['key']}"}


@dataclass(frozen=True)
class Gateway:
    http: str
    grpc: str
    model: str

    def client(self, key_name: str | None = "acme", timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=f"http://{self.http}", timeout=timeout,
                            headers=bearer(key_name) if key_name else {})


def write_configs(tmp) -> tuple[str, str]:
    engine, keys = tmp / "engine.yaml", tmp / "keys.yaml"
    engine.write_text(yaml.safe_dump(ENGINE_CONFIG))
    keys.write_text(yaml.safe_dump(list(KEYS.values())))
    return str(engine), str(keys)


def start_worker(fleet: Fleet, model_dir: str, engine_config: str, name: str = "mixed-0") -> None:
    fleet.workers[name] = fleet.launcher.start(name, [
        "services.cli.cli", "serve", "mixed", "--model", model_dir, "--worker-id", name,
        "--redis-url", fleet.redis_url, "--kv-cache-mib", "64", "--timeout-heartbeat-s", "0.3", "--timeout-heartbeat-ttl-s", "0.9",
        "--config", engine_config])
    assert wait_until(lambda: fleet.router_stub().Health(pb.HealthRequest()).status ==
                      pb.HealthResponse.SERVING, 10)


def start_gateway(fleet: Fleet, model_dir: str, name: str = "gateway", *extra: str) -> Gateway:
    http = fleet.launcher.start(name, ["services.gateway", "--model", model_dir, "--router",
                                       ",".join(fleet.routers), "--redis-url", fleet.redis_url, *extra])
    grpc_line = next(line for line in fleet.launcher.children[name].lines if line.startswith("GRPC "))
    model = model_dir.rstrip("/").rsplit("/", 1)[-1]
    return Gateway(http=http, grpc=grpc_line.split()[-1], model=model)


def sse_data(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, in order (the last one should be [DONE])."""
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def events(payloads: list[str]) -> list[dict]:
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def openai_error(response: httpx.Response, status: int) -> dict:
    """Asserts the status and OpenAI's error shape; returns the error object."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def stream_counter(redis_client, tenant: str) -> int:
    """The tenant's open streams, as services/state/fleet_state.py keeps them: live leases."""
    return redis_client.zcount(f"kvfleet:tenant:{tenant}:leases", f"({int(time.time() * 1000)}",
                               "+inf")


# ------------------------------------------------------------------------------ telemetry
def scrape(http: str) -> dict[tuple[str, frozenset], float]:
    """A gateway's /metrics (no key needed), parsed: (sample name, its labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415
    text = httpx.get(f"http://{http}/metrics", timeout=10).raise_for_status().text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


class InProcessGateway:
    """The gateway's HTTP app and gRPC service on a thread of the test process, against a real
    fleet: what an in-process span exporter needs to see the gateway's spans. Built as
    services/gateway/server.py builds it, less the signals, the lease renewer and the registry."""

    def __init__(self, fleet: Fleet, model_dir: str, engine_yaml: str, keys_yaml: str) -> None:
        import asyncio  # noqa: PLC0415
        import threading  # noqa: PLC0415
        from services.gateway.__main__ import build_config, parse_args  # noqa: PLC0415
        self._config = build_config(parse_args([
            "--model", model_dir, "--router", ",".join(fleet.routers), "--redis-url",
            fleet.redis_url, "--config", engine_yaml, "--api-keys", keys_yaml]))
        self._fleet = fleet
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._serve(),), daemon=True)
        self.http = self.grpc = ""
        self.model = self._config.served_model_name

    async def _serve(self) -> None:
        import asyncio  # noqa: PLC0415
        import grpc  # noqa: PLC0415
        from services.gateway.app import create_app  # noqa: PLC0415
        from services.gateway.core import GatewayCore  # noqa: PLC0415
        from services.gateway.grpc_api import GatewayServicer, add_to_server  # noqa: PLC0415
        from services.gateway.model import load_served_model  # noqa: PLC0415
        from services.gateway.plan import Channels  # noqa: PLC0415
        from services.gateway.quota import Quotas  # noqa: PLC0415
        from services.gateway.server import _HttpServer, bind, gateway_id  # noqa: PLC0415
        from services.state.fleet_state import FleetState  # noqa: PLC0415
        import uvicorn  # noqa: PLC0415
        c = self._config
        model = load_served_model(c.model_dir, c.served_model_name, c.max_model_len,
                                  c.quality_version)
        state = FleetState(c.redis_url)
        channels = Channels(self._fleet.auth)
        self.core = GatewayCore(c, model, Quotas(state, gateway_id()), channels)
        grpc_server = grpc.aio.server()
        add_to_server(GatewayServicer(self.core), grpc_server)
        self.grpc = f"127.0.0.1:{grpc_server.add_insecure_port('127.0.0.1:0')}"
        await grpc_server.start()
        sock = bind("127.0.0.1", 0)
        self._http = _HttpServer(uvicorn.Config(create_app(self.core), lifespan="off",
                                                log_level="warning", access_log=False))
        task = asyncio.create_task(self._http.serve(sockets=[sock]))
        while not self._http.started:
            await asyncio.sleep(0.01)
        self.http = f"127.0.0.1:{sock.getsockname()[1]}"
        self._ready.set()
        await task
        await self.core.close()
        await grpc_server.stop(0)
        await channels.close()
        await state.close()

    def __enter__(self) -> "InProcessGateway":
        self._thread.start()
        assert self._ready.wait(30), "the in-process gateway did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._http.should_exit = True
        self._thread.join(10)
        self._loop.close()
