"""`kvfleet rebalance --target kubernetes`: a pool's replica count is its workload's `spec.replicas`
in the cluster the chart (helm/kvfleet) installed it in.

The chart names each worker pool `<release>-kvfleet-<role>` (its `kvfleet.fullname`, 53
characters at most, then the role): a Deployment, or a LeaderWorkerSet when the pool's tensor
parallelism spans nodes (`--kube-kind LeaderWorkerSet`). A change is one request per pool whose
recommendation differs from what the fleet has:

    PATCH /apis/apps/v1/namespaces/<namespace>/deployments/<release>-kvfleet-<role>
    Content-Type: application/merge-patch+json
    {"spec": {"replicas": N}}

`--dry-run` prints these requests and sends nothing; `--apply` sends them to the API server, with
the credentials of the pod it runs in (its service account's token and CA, when
$KUBERNETES_SERVICE_HOST is set) or of the current context of a kubeconfig (a bearer token or a
client certificate; an exec plugin is not supported). The scale-down of a worker Deployment is
the chart's drain: Kubernetes runs the pod's preStop hook (SIGUSR1: the worker reports
NOT_SERVING, leaves Redis, finishes what it holds) before it stops it.
"""
from __future__ import annotations

import base64
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from services.planner.rebalance import Outcome
from services.protocol import env

FULLNAME_MAX = 53                      # the chart's kvfleet.fullname: trunc 53 | trimSuffix "-"
MERGE_PATCH = "application/merge-patch+json"
KINDS = {"Deployment": "/apis/apps/v1/namespaces/{ns}/deployments/{name}",
         "LeaderWorkerSet": "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets/{name}"}
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REQUEST_TIMEOUT_S = 10.0


class KubeError(ValueError):
    """The cluster's credentials or address cannot be read, or a request is refused."""


def workload_name(release: str, pool: str) -> str:
    """The chart's name of a pool's workload."""
    return f"{release}-kvfleet"[:FULLNAME_MAX].rstrip("-") + f"-{pool}"


@dataclass(frozen=True)
class KubeRequest:
    method: str
    path: str
    body: dict
    content_type: str = MERGE_PATCH

    def show(self) -> str:
        return f"{self.method} {self.path}\nContent-Type: {self.content_type}\n" \
               f"{json.dumps(self.body, sort_keys=True)}"

    def as_dict(self) -> dict:
        return {"method": self.method, "path": self.path, "content_type": self.content_type,
                "body": self.body}


def scale_requests(outcome: Outcome, release: str, namespace: str,
                   kind: str = "Deployment") -> list[KubeRequest]:
    """One merge patch of `spec.replicas` per pool whose recommendation is a change."""
    if kind not in KINDS:
        raise KubeError(f"--kube-kind must be one of {sorted(KINDS)}, got {kind!r}")
    if not release or not namespace:
        raise KubeError("--target kubernetes needs --release (the chart's release name) and a "
                        "namespace")
    return [KubeRequest("PATCH", KINDS[kind].format(ns=namespace,
                                                    name=workload_name(release, d.pool)),
                        {"spec": {"replicas": d.recommended}})
            for d in outcome.decisions if d.delta]


@dataclass
class KubeApi:
    """Where requests go and with what credentials."""
    server: str
    token: str | None = None
    verify: str | bool = True                   # a CA bundle's path, or the system's
    cert: tuple[str, str] | None = None         # a client certificate and key
    namespace: str = "default"                  # the credentials' own (in-cluster) or context's
    _files: list[str] = field(default_factory=list, repr=False)

    @classmethod
    def discover(cls, kubeconfig: str | None) -> "KubeApi":
        """In a pod: its service account. Else the kubeconfig's current context (--kubeconfig,
        $KUBECONFIG, ~/.kube/config)."""
        if kubeconfig is None and env.KUBERNETES_SERVICE_HOST.get():
            return cls.in_cluster()
        path = kubeconfig or (env.KUBECONFIG.get() or "").split(os.pathsep)[0] or \
            os.path.expanduser("~/.kube/config")
        return cls.from_kubeconfig(path)

    @classmethod
    def in_cluster(cls, root: Path = SERVICE_ACCOUNT) -> "KubeApi":
        host, port = env.KUBERNETES_SERVICE_HOST.get(), env.KUBERNETES_SERVICE_PORT.get(default="443")
        try:
            token = (root / "token").read_text().strip()
            namespace = (root / "namespace").read_text().strip()
        except OSError as e:
            raise KubeError(f"in-cluster credentials: {e}") from None
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", token, str(root / "ca.crt"), None, namespace)

    @classmethod
    def from_kubeconfig(cls, path: str) -> "KubeApi":
        try:
            config = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise KubeError(f"kubeconfig {path}: {e}") from None
        try:
            name = config["current-context"]
            context = _named(config, "contexts", name)["context"]
            cluster = _named(config, "clusters", context["cluster"])["cluster"]
            user = _named(config, "users", context["user"]).get("user") or {}
            server = cluster["server"]
        except (KeyError, TypeError) as e:
            raise KubeError(f"kubeconfig {path}: its current context is incomplete ({e})") from None
        if "exec" in user or "auth-provider" in user:
            raise KubeError(f"kubeconfig {path}: user {context['user']!r} authenticates with an "
                            "exec plugin or auth provider, which is not supported; give a token")
        api = cls(server, namespace=context.get("namespace", "default"))
        api.token = user.get("token") or _read(user.get("tokenFile"))
        if cluster.get("insecure-skip-tls-verify"):
            api.verify = False
        elif "certificate-authority-data" in cluster:
            api.verify = api._file(cluster["certificate-authority-data"])
        elif "certificate-authority" in cluster:
            api.verify = cluster["certificate-authority"]
        if "client-certificate-data" in user and "client-key-data" in user:
            api.cert = (api._file(user["client-certificate-data"]),
                        api._file(user["client-key-data"]))
        elif "client-certificate" in user and "client-key" in user:
            api.cert = (user["client-certificate"], user["client-key"])
        return api

    def _file(self, data_b64: str) -> str:
        """A kubeconfig's inline PEM (base64) as a private file for httpx; removed by close()."""
        fd, path = tempfile.mkstemp(prefix="kvfleet-kube-", suffix=".pem")
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64decode(data_b64))
        self._files.append(path)
        return path

    def close(self) -> None:
        for path in self._files:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._files.clear()

    def send(self, request: KubeRequest) -> tuple[bool, str]:
        """(accepted, what the server said in a line)."""
        headers = {"Content-Type": request.content_type, "Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            with httpx.Client(base_url=self.server, verify=self.verify, cert=self.cert,
                              timeout=REQUEST_TIMEOUT_S) as client:
                r = client.request(request.method, request.path, headers=headers,
                                   content=json.dumps(request.body))
        except httpx.HTTPError as e:
            return False, f"{request.method} {request.path}: {type(e).__name__}: {e}"
        if r.is_success:
            return True, f"{request.method} {request.path} -> {r.status_code}"
        return False, f"{request.method} {request.path} -> {r.status_code}: {_reason(r)}"


def apply(api: KubeApi, requests: list[KubeRequest]) -> tuple[list[dict], bool]:
    """Send each request; (what each did, all accepted)."""
    done, ok = [], True
    for request in requests:
        accepted, detail = api.send(request)
        ok &= accepted
        done.append({"action": "scale", "role": request.path.rsplit("-", 1)[-1],
                     "replicas": request.body["spec"]["replicas"], "accepted": accepted,
                     "detail": detail, "request": request.as_dict()})
    return done, ok


def _named(config: dict, section: str, name: str) -> dict:
    for entry in config.get(section) or []:
        if entry.get("name") == name:
            return entry
    raise KeyError(f"no {section[:-1]} named {name!r}")


def _read(path: str | None) -> str | None:
    if not path:
        return None
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise KubeError(f"kubeconfig tokenFile {path}: {e}") from None


def _reason(r: httpx.Response) -> str:
    try:
        return str(r.json().get("message", r.text[:200]))
    except ValueError:
        return r.text[:200]
