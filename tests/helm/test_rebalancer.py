"""The chart's optional rebalancer (`rebalancer.enabled`): `kvfleet rebalance --target kubernetes`
in the cluster, and exactly the rights it needs. Its command line is parsed by the real
`kvfleet rebalance` parser, and the requests that parse leads to (services/planner/
rebalance_k8s.py) go only to workloads the Role names, which are exactly the pools the chart
renders. No cluster: what Kubernetes would allow is read from the Role, as its RBAC reads it."""
from __future__ import annotations

import pytest

from services.planner import rebalance_k8s as k8s
from tests.helm.chart import (NAMESPACE, RELEASE, VALUE_SETS, helm, render, render_values,
                              values_of)
from tests.helm.test_commands import SAMPLE, kvfleet_containers, parse, parse_only  # noqa: F401
from tests.helm.test_rebalance_kubernetes import outcome, pools

pytest.importorskip("helm_python")
ENABLED = sorted(v for v in VALUE_SETS if values_of(v).get("rebalancer", {}).get("enabled"))
APPLYING = [v for v in ENABLED if values_of(v)["rebalancer"]["mode"] == "apply"]
RESOURCES = {"Deployment": ("apps", "deployments"),
             "LeaderWorkerSet": ("leaderworkerset.x-k8s.io", "leaderworkersets")}


def rebalancer_args(value_set: str):
    [container] = [c for w, c in kvfleet_containers(value_set) if w.endswith("/rebalancer")]
    return parse(container)


def allowed(value_set: str) -> set[tuple[str, str, str, str]]:
    """(verb, API group, resource, name) the Role grants: every combination of each rule."""
    role = render(value_set).named("Role", "-rebalancer")
    return {(verb, group, resource, name) for rule in role["rules"] for verb in rule["verbs"]
            for group in rule["apiGroups"] for resource in rule["resources"]
            for name in rule["resourceNames"]}


def test_the_value_sets_cover_both_kinds_and_both_modes():
    assert {"disaggregated", "multi-node-tp"} <= set(APPLYING)
    assert "hybrid" in ENABLED and "hybrid" not in APPLYING                 # advisory
    assert not any("rebalancer" in o["metadata"]["name"] for o in render("default").objects)


@pytest.mark.parametrize("value_set", APPLYING)
def test_the_role_names_exactly_the_pools_workloads_and_only_reads_and_patches(value_set):
    expected = {(verb, *RESOURCES[o["kind"]], o["metadata"]["name"])
                for o in pools(value_set).values() for verb in ("get", "patch")}
    assert allowed(value_set) == expected
    fleet = render(value_set)
    binding = fleet.named("RoleBinding", "-rebalancer")
    account = fleet.named("ServiceAccount", "-rebalancer")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": fleet.named("Role", "-rebalancer")["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "namespace": NAMESPACE,
                                    "name": account["metadata"]["name"]}]
    [job] = fleet.of_kind("CronJob")
    pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert job["spec"]["schedule"] == values_of(value_set)["rebalancer"]["schedule"]
    assert job["spec"]["concurrencyPolicy"] == "Forbid"           # one measurement at a time


@pytest.mark.parametrize("value_set", APPLYING)
def test_the_command_it_runs_patches_only_what_its_role_allows(value_set, parse_only):  # noqa: F811
    args = rebalancer_args(value_set)
    assert (args.target, args.apply, args.release, args.namespace) == (
        "kubernetes", True, RELEASE, NAMESPACE)
    assert args.redis_url == SAMPLE["KVFLEET_REDIS_URL"]
    assert args.window_s == values_of(value_set)["rebalancer"]["windowS"]
    requests = k8s.scale_requests(outcome({role: (1, 2) for role in pools(value_set)}),
                                  args.release, args.namespace, args.kube_kind)
    assert len(requests) == len(pools(value_set))
    for request in requests:
        # /apis/<group>/<version>/namespaces/<ns>/<resource>/<name>
        _, _, group, _, _, namespace, resource, name = request.path.split("/")
        assert namespace == NAMESPACE
        assert (request.method, group, resource) == ("PATCH", *RESOURCES[args.kube_kind])
        assert ("patch", group, resource, name) in allowed(value_set)


def test_extra_flags_reach_the_command(parse_only):  # noqa: F811
    args = rebalancer_args("disaggregated")
    assert (args.budget, args.cooldown_s) == (8, 900.0)


def test_advisory_mode_is_a_deployment_with_no_rights_and_no_api_token(parse_only):  # noqa: F811
    fleet = render("hybrid")
    assert fleet.of_kind("Role") == [] and fleet.of_kind("RoleBinding") == []
    assert fleet.of_kind("CronJob") == []
    assert fleet.named("ServiceAccount", "-rebalancer")["automountServiceAccountToken"] is False
    deployment = fleet.named("Deployment", "-rebalancer")
    assert deployment["spec"]["replicas"] == 1
    args = rebalancer_args("hybrid")
    assert (args.advisory, args.apply, args.target, args.json) == (True, False, "kubernetes", True)


def test_pools_of_two_kinds_are_refused_with_a_reason():
    values = {**values_of("disaggregated"),
              "pools": {"prefill": {"replicas": 1, "tensorParallel": 16, "gpusPerNode": 8},
                        "decode": {"replicas": 1, "tensorParallel": 1, "gpusPerNode": 8}}}
    with pytest.raises(helm().HelmRenderError, match="one kind"):
        render_values(values)
