"""`kvfleet rebalance --target kubernetes` against what the chart renders: the merge patch of a
pool's `spec.replicas` goes to a workload (Deployment, or LeaderWorkerSet for multi-node TP) of
that name in the release's namespace, in every value set; `--dry-run` prints the exact request
and sends nothing; `--apply` sends it, with a kubeconfig's token, to an API server.

No Kubernetes API server runs here: `FakeKubeApi` (named so) is a small HTTP server on 127.0.0.1
that holds the workloads of a rendered chart and answers PATCH as the API server does (a JSON
merge patch of an existing object, 404 for none, 401 without the token, 415 for another
content type)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from services.planner import rebalance_k8s as k8s
from services.planner.rebalance import POOLS, Decision, Outcome, RebalanceState, Reason
from services.protocol.fleet_token import ENV_TOKEN
from services.state import redis_auth
from tests.harness import up_fleet
from tests.helm.chart import NAMESPACE, RELEASE, VALUE_SETS, render

pytest.importorskip("helm_python")

API_TOKEN = "fake-api-server-token"
FLEET_TOKEN = "kube-rebalance-token-0123456789ab"
SIM = ["--engine", "sim", "--sim-step-ms", "2", "--sim-kv-tokens", "65536",
       "--sim-output-len", "fixed:8", "--sim-network-gbps", "100"]
POOL_KINDS = ("Deployment", "LeaderWorkerSet")


def pools(value_set: str) -> dict[str, dict]:
    """role -> the rendered workload of that worker pool."""
    return {o["metadata"]["labels"]["app.kubernetes.io/component"]: o
            for o in render(value_set).objects if o["kind"] in POOL_KINDS
            and o["metadata"]["labels"]["app.kubernetes.io/component"] in POOLS}


def outcome(changes: dict[str, tuple[int, int]]) -> Outcome:
    return Outcome(tuple(Decision(pool, cur, rec, Reason.MANUAL, 0.5, 0.5)
                         for pool, (cur, rec) in changes.items()), RebalanceState(), 0.0)


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_patch_targets_a_pool_workload_the_chart_renders(value_set):
    rendered = pools(value_set)
    assert rendered, value_set
    [kind] = {o["kind"] for o in rendered.values()}
    requests = k8s.scale_requests(outcome({role: (1, 3) for role in rendered}), RELEASE,
                                  NAMESPACE, kind)
    assert len(requests) == len(rendered)
    for request in requests:
        prefix, name = request.path.rsplit("/", 1)
        role = name.rsplit("-", 1)[1]
        assert rendered[role]["metadata"]["name"] == name
        assert f"/namespaces/{NAMESPACE}/" in prefix                 # the release's namespace
        group = "apps/v1" if kind == "Deployment" else "leaderworkerset.x-k8s.io/v1"
        api_version = rendered[role]["apiVersion"]
        assert request.path.startswith(f"/apis/{group}/") and api_version == group
        assert (request.method, request.content_type, request.body) == (
            "PATCH", "application/merge-patch+json", {"spec": {"replicas": 3}})
        assert "replicas" in rendered[role]["spec"]       # the field the patch sets exists


def test_an_unchanged_pool_gets_no_request_and_a_long_release_name_is_cut_as_the_chart_cuts():
    assert k8s.scale_requests(outcome({"decode": (2, 2), "prefill": (1, 2)}), "r", "ns") == [
        k8s.KubeRequest("PATCH", "/apis/apps/v1/namespaces/ns/deployments/r-kvfleet-prefill",
                        {"spec": {"replicas": 2}})]
    long = "x" * 60
    assert k8s.workload_name(long, "decode") == "x" * 53 + "-decode"
    with pytest.raises(k8s.KubeError, match="--kube-kind"):
        k8s.scale_requests(outcome({"decode": (1, 2)}), "r", "ns", "StatefulSet")


# ------------------------------------------------------------------ a stand-in API server

class FakeKubeApi:
    """The workloads of a rendered chart behind PATCH, on 127.0.0.1 (see the module docstring)."""

    def __init__(self, value_set: str, namespace: str = NAMESPACE) -> None:
        self.objects = {k8s.KINDS[o["kind"]].format(ns=namespace, name=o["metadata"]["name"]):
                        json.loads(json.dumps(o)) for o in pools(value_set).values()}
        self.seen: list[tuple[str, str, dict]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_PATCH(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.seen.append((self.command, self.path, body))
                if self.headers.get("Authorization") != f"Bearer {API_TOKEN}":
                    return self._answer(401, {"message": "Unauthorized"})
                if self.headers.get("Content-Type") != k8s.MERGE_PATCH:
                    return self._answer(415, {"message": "unsupported media type"})
                obj = api.objects.get(self.path)
                if obj is None:
                    return self._answer(404, {"message": f"{self.path} not found"})
                obj["spec"].update(body.get("spec", {}))
                return self._answer(200, obj)

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def replicas(self, role: str) -> int:
        [obj] = [o for p, o in self.objects.items() if p.endswith(f"-{role}")]
        return obj["spec"]["replicas"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def api_server():
    server = FakeKubeApi("disaggregated")
    yield server
    server.close()


def kubeconfig(tmp_path, server: str, user: dict, namespace: str = NAMESPACE) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "ci",
        "contexts": [{"name": "ci", "context": {"cluster": "c", "user": "u",
                                                "namespace": namespace}}],
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": user}]}))
    return str(path)


def test_apply_patches_the_rendered_workloads_and_says_what_the_server_refused(api_server,
                                                                               tmp_path):
    api = k8s.KubeApi.from_kubeconfig(kubeconfig(tmp_path, api_server.url, {"token": API_TOKEN}))
    assert (api.server, api.token, api.namespace) == (api_server.url, API_TOKEN, NAMESPACE)
    done, ok = k8s.apply(api, k8s.scale_requests(outcome({"decode": (1, 3), "prefill": (1, 2)}),
                                                 RELEASE, api.namespace))
    assert ok and [d["accepted"] for d in done] == [True, True]
    assert (api_server.replicas("decode"), api_server.replicas("prefill")) == (3, 2)

    done, ok = k8s.apply(api, k8s.scale_requests(outcome({"decode": (3, 1)}), "other", NAMESPACE))
    assert not ok and "-> 404" in done[0]["detail"] and "not found" in done[0]["detail"]
    api.token = "wrong"
    done, ok = k8s.apply(api, k8s.scale_requests(outcome({"decode": (3, 1)}), RELEASE, NAMESPACE))
    assert not ok and "-> 401" in done[0]["detail"] and api_server.replicas("decode") == 3


def test_a_kubeconfig_it_cannot_use_is_a_clear_error(tmp_path):
    path = kubeconfig(tmp_path, "https://127.0.0.1:6443", {"exec": {"command": "aws"}})
    with pytest.raises(k8s.KubeError, match="exec plugin"):
        k8s.KubeApi.from_kubeconfig(path)
    with pytest.raises(k8s.KubeError, match="kubeconfig"):
        k8s.KubeApi.from_kubeconfig(str(tmp_path / "missing"))
    (tmp_path / "broken").write_text("current-context: nowhere\n")
    with pytest.raises(k8s.KubeError, match="incomplete"):
        k8s.KubeApi.from_kubeconfig(str(tmp_path / "broken"))


def test_inline_certificates_become_private_files_that_close_removes(tmp_path):
    import base64
    pem = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode()
    path = kubeconfig(tmp_path, "https://127.0.0.1:6443",
                      {"client-certificate-data": pem, "client-key-data": pem})
    api = k8s.KubeApi.from_kubeconfig(path)
    files = list(api.cert)
    assert all(os.stat(f).st_mode & 0o077 == 0 for f in files)
    api.close()
    assert not any(map(os.path.exists, files))


# ------------------------------------------------------------------ the command on a fleet

def rebalance(up, tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, ENV_TOKEN: FLEET_TOKEN, redis_auth.ENV_PASSWORD: up.redis_password}
    return subprocess.run([sys.executable, "-m", "services.cli.cli", "rebalance", "--target",
                           "kubernetes", "--redis-url", up.redis_url, "--audit-log",
                           str(tmp_path / "audit.jsonl"), "--window-s", "0.5", "--budget", "4",
                           "--cooldown-s", "0", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_the_command_prints_the_request_on_a_dry_run_and_sends_it_on_apply(
        tiny_model_dir, tmp_path, api_server, monkeypatch):
    monkeypatch.setenv(ENV_TOKEN, FLEET_TOKEN)
    config = kubeconfig(tmp_path, api_server.url, {"token": API_TOKEN})
    with up_fleet(tiny_model_dir, *SIM, mode="disagg", token=FLEET_TOKEN) as up:
        dry = rebalance(up, tmp_path, "--dry-run", "--replicas", "decode=2", "--release",
                        RELEASE, "--namespace", NAMESPACE)
        assert dry.returncode == 0, dry.stderr
        path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{RELEASE}-kvfleet-decode"
        assert f"would send:\nPATCH {path}\nContent-Type: application/merge-patch+json\n" \
               '{"spec": {"replicas": 2}}' in dry.stdout
        assert api_server.seen == []                         # a dry run sends nothing

        applied = rebalance(up, tmp_path, "--apply", "--replicas", "decode=2", "--release",
                            RELEASE, "--kubeconfig", config, "--json")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        [order] = json.loads(applied.stdout.strip().splitlines()[-1])["orders"]
        assert order["accepted"] and order["request"]["path"] == path
        assert api_server.seen == [("PATCH", path, {"spec": {"replicas": 2}})]
        assert api_server.replicas("decode") == 2
    audit = [json.loads(line) for line in open(tmp_path / "audit.jsonl")]
    assert [a["mode"] for a in audit] == ["dry-run", "apply"]
    assert audit[0]["requests"][0]["path"] == path


def test_without_a_release_it_says_so_before_measuring(tmp_path):
    out = subprocess.run([sys.executable, "-m", "services.cli.cli", "rebalance", "--target",
                          "kubernetes", "--audit-log", str(tmp_path / "a.jsonl")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--release" in out.stderr and "Traceback" not in out.stderr
