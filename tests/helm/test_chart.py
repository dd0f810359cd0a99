"""The chart lints, renders for every value set, and every rendered object is a valid object of a
current Kubernetes release; values and output pass yamllint."""
from __future__ import annotations

import json

import pytest
import yaml

from services.telemetry.grafana.boards import DASHBOARD_DIR
from tests.helm.chart import CHART, KUBERNETES, VALUE_SETS, pod_specs, render, values_of

pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
yamllint_config = pytest.importorskip("yamllint.config")
from yamllint import linter  # noqa: E402

# Kinds whose schemas are CRDs, not Kubernetes': kubernetes-validate has no schema for them.
# A LeaderWorkerSet's pod templates are still validated, as v1 PodTemplates (below).
CRD_KINDS = {
    "LeaderWorkerSet": "a CRD of the LWS project (leaderworkerset.x-k8s.io), not in Kubernetes' OpenAPI",
    "ServiceMonitor": "a CRD of the Prometheus operator (monitoring.coreos.com), not in Kubernetes' OpenAPI",
    "PodMonitor": "a CRD of the Prometheus operator (monitoring.coreos.com), not in Kubernetes' OpenAPI",
}
YAMLLINT = yamllint_config.YamlLintConfig(
    "extends: default\nrules: {line-length: {max: 120}, truthy: {check-keys: false}}\n")
SETS = sorted(VALUE_SETS)


def test_the_value_sets_asked_for_are_all_there():
    assert set(SETS) >= {"default", "disaggregated", "colocated", "hybrid", "external-redis",
                         "multi-node-tp"}


@pytest.mark.parametrize("value_set", SETS)
def test_helm_lint_finds_nothing_wrong_with_the_chart(value_set):
    from tests.helm.chart import helm
    report = helm().lint(CHART, values_of(value_set), strict=True, kube_version=f"v{KUBERNETES}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("value_set", SETS)
def test_every_rendered_object_is_valid_for_a_current_kubernetes(value_set):
    validated = 0
    for obj in render(value_set).objects:
        if obj["kind"] in CRD_KINDS:
            for where, spec in pod_specs(obj):
                template = {"apiVersion": "v1", "kind": "PodTemplate",
                            "metadata": {"name": f"{obj['metadata']['name']}-{where.lower()}"},
                            "template": {"spec": spec}}
                kubernetes_validate.validate(template, KUBERNETES, strict=True)
            continue
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        validated += 1
    assert validated >= 8


@pytest.mark.parametrize("value_set", SETS)
def test_the_rendered_output_passes_yamllint(value_set):
    problems = list(linter.run(render(value_set).text, YAMLLINT))
    assert problems == [], "\n".join(map(str, problems))


@pytest.mark.parametrize("path", [CHART / "values.yaml", CHART / "Chart.yaml",
                                  *VALUE_SETS.values()], ids=lambda p: p.name)
def test_the_charts_own_yaml_passes_yamllint(path):
    problems = list(linter.run(path.read_text(encoding="utf-8"), YAMLLINT))
    assert problems == [], "\n".join(map(str, problems))


def test_the_default_fleet_is_disaggregated_with_two_routers_and_one_pod_per_pool():
    fleet = render("default")
    assert fleet.named("Deployment", "-router")["spec"]["replicas"] == 2
    pools = {d["metadata"]["labels"]["app.kubernetes.io/component"]
             for d in fleet.of_kind("Deployment")}
    assert pools == {"gateway", "router", "prefill", "decode"}
    assert fleet.of_kind("StatefulSet")[0]["metadata"]["name"].endswith("-redis")
    assert {p["metadata"]["name"].rsplit("-", 1)[-1] for p in fleet.of_kind("PodDisruptionBudget")} \
        == {"gateway", "router", "prefill", "decode"}


@pytest.mark.parametrize("value_set, pools", [("colocated", {"mixed"}),
                                               ("hybrid", {"mixed", "prefill", "decode"}),
                                               ("disaggregated", {"prefill", "decode"})])
def test_each_mode_runs_the_pools_it_uses(value_set, pools):
    services = ("gateway", "router", "rebalancer")
    workers = [d for d in render(value_set).of_kind("Deployment")
               if d["metadata"]["labels"]["app.kubernetes.io/component"] not in services]
    assert {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in workers} == pools


def test_tensor_parallelism_past_one_node_makes_each_replica_a_leader_worker_set():
    fleet = render("multi-node-tp")
    sets = {s["metadata"]["name"].rsplit("-", 1)[-1]: s for s in fleet.of_kind("LeaderWorkerSet")}
    assert set(sets) == {"prefill", "decode"}
    assert sets["decode"]["spec"]["replicas"] == 2
    assert sets["decode"]["spec"]["leaderWorkerTemplate"]["size"] == 2      # 16 GPUs / 8 a node
    leader = sets["decode"]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    resources = leader["containers"][0]["resources"]["limits"]
    assert resources["nvidia.com/gpu"] == 8 and resources["rdma/hca_shared_devices_a"] == 1


def test_a_worker_drains_before_it_stops_and_is_given_the_time_to():
    for where, spec in pod_specs(render("default").named("Deployment", "-decode")):
        worker = spec["containers"][0]
        assert "kill -USR1 1" in worker["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert spec["terminationGracePeriodSeconds"] > 600       # the drain's own limit
        assert worker["readinessProbe"]["grpc"]["port"] == worker["ports"][0]["containerPort"]
        assert "tcpSocket" in worker["livenessProbe"]   # a draining worker is not restarted
        assert worker["startupProbe"]["failureThreshold"] * worker["startupProbe"]["periodSeconds"] \
            >= 600                                       # a large model's load


def test_a_slices_prefill_and_decode_pods_share_one_topology_domain():
    fleet = render("default")
    terms = [spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
             for role in ("-prefill", "-decode")
             for _, spec in pod_specs(fleet.named("Deployment", role))]
    assert terms[0] == terms[1]
    assert terms[0][0]["topologyKey"] == values_of("default").get("topology", {}).get(
        "key", yaml.safe_load((CHART / "values.yaml").read_text())["topology"]["key"])


def test_an_external_redis_leaves_out_the_bundled_one_and_the_secrets_made_elsewhere():
    fleet = render("external-redis")
    assert fleet.of_kind("StatefulSet") == []
    [secret] = fleet.of_kind("Secret")
    assert set(secret["data"]) == {"redis-url"}


def test_only_the_gateway_is_reachable_from_outside_the_release():
    policies = {p["metadata"]["name"].rsplit("-", 1)[-1]: p["spec"]
                for p in render("default").of_kind("NetworkPolicy")}
    internal = policies["internal"]
    assert {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["gateway"]} \
        in internal["podSelector"]["matchExpressions"]
    assert internal["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/instance": "ci"}}}]}]
    assert policies["gateway"]["ingress"] == [{"ports": [{"port": "http"}, {"port": "grpc"}]}]


def test_the_bundled_redis_url_carries_the_password_redis_is_started_with():
    import base64
    [secret] = render("default").of_kind("Secret")
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert len(data["redis-password"]) >= 32 and len(data["fleet-token"]) >= 32
    assert data["redis-url"] == f"redis://:{data['redis-password']}@ci-kvfleet-redis:6379/0"
    redis = render("default").of_kind("StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]
    assert redis["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert redis["env"][0]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"


def test_the_grafana_dashboards_ship_as_config_maps_grafanas_sidecar_picks_up():
    """Each dashboard the repo renders (services/telemetry/grafana/boards.py) is one ConfigMap
    with the sidecar's label, its JSON unchanged, under the 1 MiB a ConfigMap may hold."""
    shipped = {path.name: json.loads(path.read_text(encoding="utf-8"))
               for path in DASHBOARD_DIR.glob("*.json")}
    maps = render("disaggregated").of_kind("ConfigMap")
    assert len(shipped) >= 3 and len(maps) == len(shipped)
    found = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "kvfleet"}
        [(name, text)] = cm["data"].items()
        assert len(text.encode()) < 1 << 20
        found[name] = json.loads(text)
    assert found == shipped
    assert render("default").of_kind("ConfigMap") == []        # off unless asked for


def test_every_router_and_worker_pod_serves_the_metrics_port_its_pod_monitor_scrapes():
    fleet = render("disaggregated")
    [monitor] = fleet.of_kind("PodMonitor")
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    [components] = [e["values"] for e in monitor["spec"]["selector"]["matchExpressions"]
                    if e["key"] == "app.kubernetes.io/component"]
    port = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))["ports"]["metrics"]
    scraped = 0
    for obj in fleet.objects:
        component = obj["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        if obj["kind"] not in ("Deployment", "LeaderWorkerSet") or component not in components:
            continue
        where, spec = pod_specs(obj)[0]                   # the leader's, where a replica spans nodes
        [container] = [c for c in spec["containers"] if c["name"] in ("router", "worker")]
        assert {"name": "metrics", "containerPort": port} in container["ports"], (where, obj)
        assert f"--metrics-port={port}" in container["args"]
        scraped += 1
    assert scraped == 3                                   # router, prefill and decode pools


def test_scrapers_named_in_values_reach_the_metrics_port_and_nothing_else():
    internal = render("disaggregated").named("NetworkPolicy", "internal")["spec"]["ingress"]
    assert internal[1] == {"from": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}], "ports": [{"port": "metrics"}]}
    assert len(render("default").named("NetworkPolicy", "internal")["spec"]["ingress"]) == 1
