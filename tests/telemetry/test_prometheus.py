"""Every PromQL expression the repo ships, evaluated by a real Prometheus scraping a real fleet.

The story: `kvfleet up` starts a disaggregated fleet (gateway, router, one prefill and one decode
worker, embedded Redis) with two tenants' API keys; a Prometheus on loopback runs the repo's own
prometheus.yml and alerts.yml (1-s intervals), its targets the file `kvfleet status
--prometheus-sd` writes from the fleet's Redis (every worker's WorkerStats.metrics_url, every
gateway's and router's ServiceRecord). A short load runs: streamed requests from two tenants in
two classes (one a long document), one cancelled stream, requests refused by a tenant's quota,
and one long stream still running while the queries are asked. Then every dashboard target,
dashboard variable, recording rule and alert operand must parse and return at
least one series: a metric renamed, dropped or never wired into a service fails here.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from tests.waiting import wait_until
from services.state.redis_server import free_port
from services.telemetry import promql
from tests.harness import up_fleet, redis_env
from tests.gateway.gateway_helpers import KEYS, write_configs

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed (`make` installs Debian's prometheus)")
TARGETS_TIMEOUT_S = 60
SERIES_TIMEOUT_S = 45


# --- the fleet and what Prometheus scrapes -------------------------------------------------------

def write_targets(redis_url: str, path: Path, roles: set[str]) -> list[dict]:
    """`kvfleet status --prometheus-sd`, as an operator runs it, until the file lists a process
    of every role in `roles` (a process shows up with its first heartbeat); returns its groups."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + TARGETS_TIMEOUT_S
    while True:
        out = subprocess.run([sys.executable, "-m", "services.cli.cli", "status", "--redis-url",
                              redis_url, "--prometheus-sd", str(path)],
                             capture_output=True, text=True, timeout=60, env=redis_env())
        assert out.returncode == 0, out.stdout + out.stderr
        groups = json.loads(path.read_text())
        if {g["labels"]["role"] for g in groups} >= roles or time.monotonic() > deadline:
            return groups
        time.sleep(0.2)


@contextmanager
def prometheus(tmp: Path):
    """The repo's prometheus.yml and alerts.yml, with 1-s scrape and rule intervals, on a free
    loopback port, its targets from tmp/targets/*.json; yields its base URL. Stopped (SIGTERM,
    then SIGKILL) whatever happens."""
    config = yaml.safe_load((promql.PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["scrape_configs"][0]["file_sd_configs"][0]["refresh_interval"] = "1s"
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(promql.RULES_FILE, tmp / "alerts.yml")
    port = free_port()
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while not _ready(url):
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "Prometheus not ready within 30 s"
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def query(url: str, expr: str) -> dict:
    """Prometheus's answer to an instant query ({"status", "data" | "error"})."""
    return httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()


def wait_for_series(url: str, expr: str, timeout_s: float = SERIES_TIMEOUT_S) -> None:
    assert wait_until(lambda: query(url, expr)["data"]["result"], timeout_s, 0.2), \
        f"no series for {expr} within {timeout_s:.0f} s"


# --- the load ------------------------------------------------------------------------------------

class Load:
    """Requests through the gateway's REST API, each as a client would send them."""

    def __init__(self, http: str) -> None:
        self.url = f"http://{http}"
        models = httpx.get(f"{self.url}/v1/models", headers=_bearer("acme")).json()
        self.model = models["data"][0]["id"]
        self.open: list[threading.Thread] = []

    def body(self, max_tokens: int, prompt: str = "the fleet has many workers and",
             **extra) -> dict:
        return {"model": self.model, "prompt": prompt, "stream": True, "max_tokens": max_tokens,
                "temperature": 0, **extra}

    def stream(self, key: str, max_tokens: int = 12, prompt: str | None = None) -> int:
        """One streamed completion read to its end; returns the HTTP status."""
        body = self.body(max_tokens, **({"prompt": prompt} if prompt else {}))
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, headers=_bearer(key),
                          timeout=60) as r:
            for _ in r.iter_lines():
                pass
            return r.status_code

    def cancel_after_first_token(self, key: str) -> None:
        """A client that goes away after its first token (the gateway cancels the request)."""
        with httpx.stream("POST", f"{self.url}/v1/completions", timeout=60, headers=_bearer(key),
                          json=self.body(4000, ignore_eos=True)) as r:
            assert r.status_code == 200, r.read()
            next(line for line in r.iter_lines() if line.startswith("data: {"))

    def long_stream(self, key: str) -> threading.Event:
        """A stream that runs until `stop` is set (or its tokens run out); returns `stop`."""
        stop, first = threading.Event(), threading.Event()

        def read():
            try:
                with httpx.stream("POST", f"{self.url}/v1/completions", timeout=120,
                                  headers=_bearer(key), json=self.body(4000, ignore_eos=True)) as r:
                    for _ in r.iter_lines():
                        first.set()
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                pass                  # the fleet went away under it (the test is over)
        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        self.open.append(thread)
        assert first.wait(60), "the long stream had no first token within 60 s"
        return stop


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[key]['key']}"}


def run_load(load: Load, prometheus_url: str) -> None:
    # A document long enough to fill a prefill step: the prefill worker measures its rate from
    # such steps, and the router predicts TTFT (kvfleet_predicted_ttft_seconds) once it has one.
    assert load.stream("doc", prompt="the fleet has many workers and " * 120) == 200
    wait_for_series(prometheus_url, 'kvfleet_engine_tokens_per_second{role="prefill", '
                                    'phase="prefill"} > 0')
    for key in ("acme", "acme", "doc", "solo", "solo"):      # two tenants, two classes
        assert load.stream(key) == 200, key
    load.cancel_after_first_token("leaver")
    statuses = [load.stream("metered", max_tokens=2) for _ in range(3)]  # 2 requests a minute
    assert statuses == [200, 200, 429], statuses


# --- the test ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scraped_fleet(tiny_model_dir, tmp_path_factory):
    """(Prometheus URL, the fleet's targets) after the load, with one stream still running."""
    tmp = tmp_path_factory.mktemp("prometheus")
    engine_yaml, keys_yaml = write_configs(tmp)
    with up_fleet(tiny_model_dir, mode="disagg", config=engine_yaml, api_keys=keys_yaml) as up:
        targets = write_targets(up.redis_url, tmp / "targets" / "kvfleet.json",
                                {"gateway", "router", "prefill", "decode"})
        with prometheus(tmp) as url:
            load = Load(up.http)
            run_load(load, url)
            stop = load.long_stream("solo")
            try:
                for outcome in ("finished", "cancelled", "rejected"):   # the load's endings
                    wait_for_series(url, f'kvfleet_requests_total{{outcome="{outcome}"}}')
                wait_for_series(url, 'sum(kvfleet_tenant_sequences{tenant="solo"}) > 0')
                yield url, targets
            finally:
                stop.set()
                for thread in load.open:
                    thread.join(10)


def test_every_process_of_the_fleet_is_a_target_and_up(scraped_fleet):
    url, targets = scraped_fleet
    assert sorted(g["labels"]["role"] for g in targets) == \
        ["decode", "gateway", "prefill", "router"], targets
    deadline = time.monotonic() + TARGETS_TIMEOUT_S
    while True:
        active = httpx.get(f"{url}/api/v1/targets").json()["data"]["activeTargets"]
        health = {t["labels"]["kvfleet_id"]: t["health"] for t in active}
        if len(health) == len(targets) and set(health.values()) == {"up"}:
            break
        assert time.monotonic() < deadline, (health, [t.get("lastError") for t in active])
        time.sleep(0.2)


def test_every_metric_family_the_services_define_is_scraped(scraped_fleet):
    """Each name in metrics.py reaches Prometheus from some process (its HELP/TYPE at least)."""
    url, _ = scraped_fleet
    exported = promql.exported_names()
    wanted = {name.removesuffix("_total") for name in exported
              if not name.endswith(("_bucket", "_sum", "_count"))}
    wanted |= {name.removesuffix("_bucket") for name in exported if name.endswith("_bucket")}
    deadline = time.monotonic() + SERIES_TIMEOUT_S
    while True:
        seen = {name.removesuffix("_total")
                for name in httpx.get(f"{url}/api/v1/metadata").json()["data"]}
        if wanted <= seen or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not wanted - seen, f"never scraped: {sorted(wanted - seen)}"


def test_every_dashboard_and_rule_expression_returns_series(scraped_fleet):
    url, _ = scraped_fleet
    queries = promql.all_queries()
    empty: dict[str, str] = {}
    deadline = time.monotonic() + SERIES_TIMEOUT_S
    while True:          # series appear as scrapes and rule evaluations land: ask until all do
        empty = {}
        for q in queries:
            answer = query(url, q.expr)
            assert answer["status"] == "success", f"{q.source}: {q.expr}\n{answer.get('error')}"
            if not answer["data"]["result"]:
                empty[q.source] = q.expr
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not empty, "no series for:\n" + "\n".join(f"  {s}: {e}" for s, e in empty.items())


def test_series_keep_their_own_role_labels(scraped_fleet):
    """The targets' `role` label (kvfleet status) is renamed kvfleet_role before the scrape, so a
    router's per-role series say which role they count, not "router"."""
    url, _ = scraped_fleet
    roles = query(url, "count by (role) (kvfleet_router_live_workers)")["data"]["result"]
    assert {r["metric"]["role"] for r in roles} == {"prefill", "decode", "mixed"}
    assert query(url, '{exported_role!=""}')["data"]["result"] == []
    workers = query(url, "count by (kvfleet_role, role) (kvfleet_kv_cache_usage_perc)")
    assert {(r["metric"]["kvfleet_role"], r["metric"]["role"])
            for r in workers["data"]["result"]} == {("prefill", "prefill"), ("decode", "decode")}


def test_a_healthy_fleet_raises_no_alert(scraped_fleet):
    """Nothing pending or firing: in particular no alert for the role a disaggregated fleet does
    not use (mixed = 0) and none for idle KV writers. The SLO burn alerts are left out: whether a
    request met its targets depends on how loaded this machine is."""
    url, _ = scraped_fleet
    wait_for_series(url, "kvfleet:slo_miss:ratio_rate5m")      # the rules have been evaluated
    alerts = query(url, 'ALERTS{alertname!~"KvfleetSLOBurnRate.*"}')["data"]["result"]
    assert alerts == [], [a["metric"] for a in alerts]
