"""The chart under helm/kvfleet, linted and rendered offline by Helm's own engine (helm-python-sdk
binds Helm v4's Go library; no helm binary, no cluster), and the value sets the tests render."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvfleet"
VALUE_SETS = {path.name.removesuffix("-values.yaml"): path
              for path in sorted((CHART / "ci").glob("*-values.yaml"))}
RELEASE, NAMESPACE = "ci", "llm"
KUBERNETES = "1.37.0"          # the newest release kubernetes-validate bundles schemas for


def helm():
    import helm_python  # noqa: PLC0415  (loads Helm's shared library on first use)
    return helm_python


def values_of(value_set: str) -> dict:
    return yaml.safe_load(VALUE_SETS[value_set].read_text(encoding="utf-8")) or {}


@dataclass(frozen=True)
class Rendered:
    text: str                  # every template's output, as `helm template` prints it
    objects: tuple[dict, ...]  # the Kubernetes objects in it

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def named(self, kind: str, suffix: str) -> dict:
        [found] = [o for o in self.of_kind(kind) if o["metadata"]["name"].endswith(suffix)]
        return found


def render_values(values: dict) -> Rendered:
    chart = helm().Chart.load(CHART)
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    text = "".join(f"---\n# Source: {path}\n{body.strip()}\n"
                   for path, body in sorted(manifests.items()) if body.strip())
    objects = tuple(o for o in yaml.safe_load_all(text) if o)
    return Rendered(text, objects)


@cache
def render(value_set: str) -> Rendered:
    return render_values(values_of(value_set))


def pod_specs(obj: dict) -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod template an object holds."""
    spec = obj.get("spec", {})
    if "jobTemplate" in spec:                                   # a CronJob's
        return [("jobTemplate", spec["jobTemplate"]["spec"]["template"]["spec"])]
    if "template" in spec:
        return [("template", spec["template"]["spec"])]
    lws = spec.get("leaderWorkerTemplate")
    if lws:
        return [(k, lws[k]["spec"]) for k in ("leaderTemplate", "workerTemplate") if k in lws]
    return []
