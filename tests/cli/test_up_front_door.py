"""`kvfleet up --max-in-progress 1`: the bound reaches the gateway `kvfleet up` starts. While one
streamed completion holds the only seat, a second request is refused at once (429 or 503 with
Retry-After and the S4 stage, docs/operations.md "The gateway's front door"); once the stream has
ended, the seat is free and a request is served again."""
from __future__ import annotations

import httpx

from tests.harness import up_fleet


def completion(fleet, max_tokens: int, stream: bool = False) -> dict:
    return {"model": fleet.model, "prompt": "one seat", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}


def test_up_passes_its_bound_to_the_gateway_and_a_second_request_waits_its_turn(tiny_model_dir):
    with up_fleet(tiny_model_dir, "--max-in-progress", "1", mode="colocated") as fleet:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{fleet.url}/v1/completions",
                               json=completion(fleet, 400, stream=True)) as held:
                assert held.status_code == 200
                lines = held.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))
                refused = client.post(f"{fleet.url}/v1/completions", json=completion(fleet, 4))
                assert refused.status_code in (429, 503), refused.text
                assert int(refused.headers["retry-after"]) >= 1
                assert refused.headers["x-kvfleet-stage"] == "S4_REJECT"
                assert "max_in_progress 1" in refused.json()["error"]["message"]
                assert client.get(f"{fleet.url}/health").status_code == 200
                assert [line for line in lines if line == "data: [DONE]"]
            served = client.post(f"{fleet.url}/v1/completions", json=completion(fleet, 4))
            assert served.status_code == 200, served.text
