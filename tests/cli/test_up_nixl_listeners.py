"""`kvfleet up --kv-backend nixl`: NIXL's own listener is off (metadata travels over the workers' gRPC),
but UCX's tcp transport listens on lo in every worker. The banner names that listener too, so that every
socket the fleet listens on is printed, and all of them are on 127.0.0.1."""
from __future__ import annotations

import httpx

from services.cli.launcher import descendants
from services.cli.up import Banner
from services.protocol.listeners import listening_sockets
from tests.harness import up_fleet


def test_the_banner_names_each_workers_ucx_listener_and_nothing_listens_unnamed(tiny_model_dir):
    with up_fleet(tiny_model_dir, "--kv-backend", "nixl") as up:
        proc, lines = up.proc, up.lines
        printed = Banner(list(lines)).listeners
        ucx = {service: address for service, kind, address in printed if kind == "ucx"}
        r = httpx.post(f"{up.url}/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        listening = listening_sockets([proc.pid, *descendants(proc.pid)])
    assert r.status_code == 200, r.text                     # the KV went through UCX
    assert set(ucx) == {"prefill-0", "decode-0"}, "\n".join(lines)
    assert {f"{ip}:{port}" for ip, port in listening} == {address for _, _, address in printed}
    assert {ip for ip, _ in listening} == {"127.0.0.1"}
