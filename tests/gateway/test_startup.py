"""How the gateway process starts and stops: unauthenticated only on loopback, READY lines for the
launcher, a clean exit on SIGTERM."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx
import yaml

from tests.gateway.gateway_helpers import key
from tests.harness import start_gateway


def test_without_keys_it_refuses_a_non_loopback_address_before_binding_anything(tiny_model_dir):
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "services.gateway", "--model", str(tiny_model_dir), "--router",
         "127.0.0.1:1", "--redis-url", "redis://127.0.0.1:1/0", "--host", "0.0.0.0"],
        capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "refusing to serve unauthenticated on 0.0.0.0" in proc.stderr
    assert "--insecure" in proc.stderr and "READY" not in proc.stdout and "GRPC" not in proc.stdout
    assert time.monotonic() - started < 10      # it stopped at the check, it loaded nothing


def test_without_keys_on_loopback_everyone_is_the_default_tenant(fleet, tiny_model_dir, configs):
    gw = start_gateway(fleet, str(tiny_model_dir), "open-gateway", "--config", configs[0],
                       "--served-model-name", "tiny-open")
    with httpx.Client(base_url=f"http://{gw.http}", timeout=30) as c:
        r = c.post("/v1/completions", json={"model": "tiny-open", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "tiny-open"
    child = fleet.launcher.children["open-gateway"]
    assert child.lines[0].startswith("GRPC 127.0.0.1:") and child.lines[1].startswith("READY gateway")
    fleet.launcher.stop("open-gateway")
    assert child.proc.returncode == 0            # SIGTERM: a clean stop


def test_a_keys_file_naming_a_tenant_the_workers_lack_stops_the_start(tmp_path, tiny_model_dir,
                                                                     configs):
    """Such a gateway used to start, then charge the tenant's quota and answer every request
    400 unknown_tenant. Now it refuses to start, naming what is missing, before it binds."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump([
        key("sk-acme-0001", "acme"), key("sk-stranger-0006", "stranger"),
        key("sk-acme-batch-0008", "acme", "no-such-class")]))
    proc = subprocess.run(
        [sys.executable, "-m", "services.gateway", "--model", str(tiny_model_dir), "--router",
         "127.0.0.1:1", "--redis-url", "redis://127.0.0.1:1/0", "--config", configs[0],
         "--api-keys", str(keys)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "READY" not in proc.stdout
    assert "'stranger': the engine config has no such tenant" in proc.stderr
    assert "unknown traffic class 'no-such-class'" in proc.stderr
