"""`kvfleet status` as an operator runs it against a small real fleet (`kvfleet up`: gateway, one
router, one prefill and one decode worker, the embedded Redis): every process with its role and a
metrics URL that answers, KV per worker, the overload stage; `--json` and `--prometheus-sd` give
what scripts and Prometheus read (the file_sd file is checked by `promtool`). A process that does
not answer is shown as such; Redis down is a clear error and a non-zero exit, never a traceback."""
from __future__ import annotations

import asyncio
import json
import select
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from tests.waiting import wait_until
from services.cli.status import top_tenants
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.state.fleet_state import FleetState
from services.state.redis_server import free_port
from services.state.redis_auth import RedisCredentials
from tests.harness import REDIS_PASSWORD, up_fleet, redis_env

ROLES = {"gateway", "router", "prefill", "decode"}


def status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli.cli", "status", *args],
                          capture_output=True, text=True, timeout=60, env=redis_env())


def status_json(redis_url: str) -> dict:
    out = status("--redis-url", redis_url, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    """(redis URL, gateway URL) of a running `kvfleet up`, once every process has registered."""
    with up_fleet(tiny_model_dir, mode="disagg") as up:
        redis_url = up.redis_url
        assert wait_until(lambda: {p["role"] for p in status_json(redis_url)["processes"]} == ROLES,
                          30, interval_s=0.5), status_json(redis_url)
        yield redis_url, up.url


def test_status_lists_every_process_with_a_metrics_url_that_answers(fleet):
    redis_url, _ = fleet
    view = status_json(redis_url)
    by_role = {p["role"]: p for p in view["processes"]}
    assert set(by_role) == ROLES and len(view["processes"]) == 4
    for p in view["processes"]:
        assert p["metrics"] == "ok", p
        assert httpx.get(p["metrics_url"], timeout=5).status_code == 200, p
        assert p["address"].startswith("127.0.0.1:"), p
    assert by_role["router"]["id"] == "router-0" and by_role["router"]["pid"] > 0
    assert sorted(view["prometheus_targets"]) == sorted(p["metrics_url"] for p in view["processes"])

    # KV per worker, from its own heartbeat; the stage, from the router's /metrics
    workers = {w["id"]: w for w in view["workers"]}
    assert set(workers) == {"prefill-0", "decode-0"}
    for w in workers.values():
        assert w["kv_total"] > 0 and 0 <= w["kv_used"] + w["kv_reserved"] <= w["kv_total"]
        assert w["queue_age_s"] is not None, w              # read from its /metrics
    assert (view["stage"], view["stage_name"], view["stage_from"]) == (0, "S0_NORMAL", "router-0")


def test_the_text_view_names_every_process_and_the_stage(fleet):
    redis_url, _ = fleet
    out = status("--redis-url", redis_url)
    assert out.returncode == 0, out.stderr
    for word in ("PROCESSES", "WORKERS", "QUEUE AGE", "TENANTS", "router-0", "prefill-0", "decode-0",
                 "gateway", "overload stage S0_NORMAL"):
        assert word in out.stdout, out.stdout


def test_prometheus_sd_writes_a_file_sd_that_promtool_accepts(fleet, tmp_path):
    redis_url, _ = fleet
    sd = tmp_path / "kvfleet.json"
    out = status("--redis-url", redis_url, "--prometheus-sd", str(sd))
    assert out.returncode == 0, out.stderr
    groups = json.loads(sd.read_text())
    assert {(g["labels"]["role"], g["labels"]["id"]) for g in groups} >= {
        ("router", "router-0"), ("prefill", "prefill-0"), ("decode", "decode-0")}
    assert {g["labels"]["role"] for g in groups} == ROLES
    for g in groups:
        (target,) = g["targets"]
        assert httpx.get(f"http://{target}{g['labels']['__metrics_path__']}", timeout=5) \
            .status_code == 200
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (make installs it): the file's structure was checked")
    config = tmp_path / "prometheus.yml"
    config.write_text(f"scrape_configs:\n  - job_name: kvfleet\n    file_sd_configs:\n"
                      f"      - files: ['{sd}']\n")
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_watch_refreshes_until_ctrl_c(fleet):
    redis_url, _ = fleet
    # As from an operator's terminal: Ctrl-C delivered. (A test run started in the background of
    # a non-interactive shell, `make test &`, inherits SIGINT ignored, and so would the child.)
    proc = subprocess.Popen([sys.executable, "-m", "services.cli.cli", "status", "--redis-url",
                             redis_url, "--watch", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=redis_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        views = []
        for _ in range(2):                 # one JSON object per refresh
            ready, _, _ = select.select([proc.stdout], [], [], 30)
            assert ready, f"no refresh within 30 s ({len(views)} so far)"
            views.append(json.loads(proc.stdout.readline()))
        assert views[1]["at_unix_s"] > views[0]["at_unix_s"]
        assert all({p["role"] for p in v["processes"]} == ROLES for v in views)
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"still running 15 s after Ctrl-C; stderr: "
                                 f"{proc.communicate(timeout=10)[1][-2000:]!r}") from None
        assert code == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_process_whose_metrics_do_not_answer_is_shown_as_such(fleet):
    redis_url, _ = fleet
    ghost = pb.ServiceRecord(service_id="router-ghost", role="router", address="127.0.0.1:1",
                             metrics_url=f"http://127.0.0.1:{free_port()}/metrics",
                             updated_at_unix_s=1.0)

    async def register(up: bool):
        async with FleetState(redis_url, credentials=RedisCredentials(password=REDIS_PASSWORD)
                              ) as state:
            if up:
                await state.heartbeat_service(ghost, ttl_s=30)
            else:
                await state.remove_service(ghost.service_id)
    asyncio.run(register(True))
    try:
        out = status("--redis-url", redis_url)
    finally:
        asyncio.run(register(False))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    line = next(x for x in out.stdout.splitlines() if "router-ghost" in x)
    assert "not answering" in line, out.stdout
    # the live router still gives the stage
    assert "overload stage S0_NORMAL (from router-0" in out.stdout


def test_endpoint_reads_the_gateway_and_says_what_needs_redis(fleet):
    _, gateway = fleet
    model = httpx.get(f"{gateway}/v1/models", timeout=10).json()["data"][0]["id"]
    done = httpx.post(f"{gateway}/v1/completions", timeout=60, json={
        "model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert done.status_code == 200, done.text
    out = status("--endpoint", gateway, "--json")
    assert out.returncode == 0, out.stderr
    view = json.loads(out.stdout)
    (process,) = view["processes"]
    assert process["role"] == "gateway" and process["metrics"] == "ok"
    assert view["gateway"]["http_status"] == 200
    assert view["gateway"]["requests"].get("finished", 0) >= 1, view["gateway"]
    assert any("--redis-url" in note for note in view["notes"])


def test_redis_down_is_a_clear_error_and_a_non_zero_exit():
    url = f"redis://127.0.0.1:{free_port()}/0"
    out = status("--redis-url", url)
    assert out.returncode == 2
    assert f"cannot read the fleet from Redis at {url}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    unreachable = status("--endpoint", f"http://127.0.0.1:{free_port()}")
    assert unreachable.returncode == 2 and "does not answer /health" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr


def test_top_tenants_sum_every_workers_share_and_rank_by_kv():
    def worker(wid, *shares):
        return pb.WorkerStats(worker_id=wid, tenants=[pb.TenantShare(tenant=t, sequences=s,
                                                                     kv_blocks=k)
                                                      for t, s, k in shares])
    workers = [worker("decode-0", ("acme", 3, 30), ("zeta", 1, 50)),
               worker("decode-1", ("acme", 1, 30), ("beta", 4, 10))]
    top = top_tenants(workers, top=2)
    assert [(t.tenant, t.sequences, t.kv_blocks) for t in top] == [("acme", 4, 60), ("zeta", 1, 50)]
    assert top[0].sequence_share == pytest.approx(4 / 9) and top[0].kv_share == pytest.approx(60 / 120)
    assert top_tenants([worker("idle")], top=5) == []
