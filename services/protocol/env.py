"""Every environment variable kvfleet reads, in one table: its name, who reads it, what for.

Settings are flags (one frozen config per component); the environment carries only what must not
be on a command line (secrets), what a child inherits from its launcher, switches for libraries
and the fault suite's injections. Every read in services/ and loadtests/ goes through a `Var` of
this table (`VAR.get(environ)`), so this file is the list an operator needs; tests/protocol/
test_env.py checks that no other module reads one by name.

Not reads of a named variable, so not here: a child's whole environment handed on (the
launcher's, `{**os.environ, ...}`); the vLLM check scripts (loadtests/check_vllm_*.py), which
set and filter vLLM's own variables for the vLLM they run.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    name: str
    read_by: str
    purpose: str

    def get(self, environ: Mapping[str, str] | None = None, default: str | None = None) -> str | None:
        """Its value in `environ` (this process's environment by default), else `default`."""
        return (os.environ if environ is None else environ).get(self.name, default)

    def pop(self, default: str = "") -> str:
        """Read it and take it out of this process's environment (so children do not inherit it)."""
        return os.environ.pop(self.name, default)

    def set(self, value: str) -> None:
        """For a library that reads it: this value, whatever was set (a safety setting)."""
        os.environ[self.name] = value

    def set_default(self, value: str) -> None:
        """For a library that reads it: this value unless the operator set one."""
        os.environ.setdefault(self.name, value)


# -- the fleet's secrets, handed from `kvfleet up` (the launcher) to every child
FLEET_TOKEN = Var("KVFLEET_FLEET_TOKEN", "every service (services/protocol/fleet_token.py)",
                  "the shared token every internal gRPC call and Redis record carries")
FLEET_TOKEN_FILE = Var("KVFLEET_FLEET_TOKEN_FILE", "every service (fleet_token.py)",
                       "a file holding the fleet token, when it is not in the environment")
INSECURE_INTERNAL = Var("KVFLEET_INSECURE_INTERNAL", "every service (fleet_token.py)",
                        "1: run without a fleet token (tests and demos only)")
REDIS_PASSWORD = Var("KVFLEET_REDIS_PASSWORD", "every Redis client (services/state/redis_auth.py)",
                     "Redis's password, never on a command line")
REDIS_PASSWORD_FILE = Var("KVFLEET_REDIS_PASSWORD_FILE", "every Redis client (redis_auth.py)",
                          "a file holding Redis's password")
REDIS_USERNAME = Var("KVFLEET_REDIS_USERNAME", "every Redis client (redis_auth.py)",
                     "Redis's ACL user name")
ALLOWED_NETWORKS = Var("KVFLEET_ALLOWED_NETWORKS", "routers and gateways (services/state/records.py)",
                       "the networks a worker's advertised address may be in")
METRICS_KEY = Var("KVFLEET_METRICS_KEY", "the gateway (services/gateway/__main__.py)",
                  "the bearer key /metrics asks for (else --metrics-key-file)")
# -- what a child inherits from its launcher
LAUNCHER_PID = Var("KVFLEET_LAUNCHER_PID", "every child of `kvfleet up` (services/cli/lifeline.py)",
                   "the pid the child must not outlive (taken out of its environment at start)")
PYTHONPATH = Var("PYTHONPATH", "a worker starting its engine core and TP ranks "
                 "(services/worker/engine_client.py, services/engine/tp_ranks.py)",
                 "kept, with the repo's root put first, in the child's environment")
# -- switches
METRICS = Var("KVFLEET_METRICS", "every service (services/telemetry/metrics.py)",
              "off: record no Prometheus metrics (to take them out when chasing a latency)")
CACHE = Var("KVFLEET_CACHE", "make-tiny-model, make-model (services/engine/tiny_model.py, "
            "model_zoo.py)", "where generated and converted checkpoints are kept "
            "(default ~/.cache/kvfleet)")
TRITON_INTERPRET = Var("TRITON_INTERPRET", "the model runner (services/engine/model/runner.py)",
                       "1: Triton kernels may run on CPU, under Triton's interpreter (tests)")
OTEL_SDK_DISABLED = Var("OTEL_SDK_DISABLED", "every service (services/telemetry/tracing.py)",
                        "true: no tracing even when an endpoint is named")
OTEL_ENDPOINT = Var("OTEL_EXPORTER_OTLP_ENDPOINT", "every service (tracing.py)",
                    "where spans go (OTLP); tracing is on when this or the next is set")
OTEL_TRACES_ENDPOINT = Var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "every service (tracing.py)",
                           "where spans go, traces only")
OTEL_SAMPLER = Var("OTEL_TRACES_SAMPLER", "every service (tracing.py)",
                   "the OpenTelemetry SDK's own sampler choice; unset: parent-based ratio")
OTEL_SAMPLER_ARG = Var("OTEL_TRACES_SAMPLER_ARG", "every service (tracing.py)",
                       "the ratio of traces sampled when OTEL_TRACES_SAMPLER is unset (default 1)")
STEP_TRACE = Var("KVFLEET_STEP_TRACE", "an engine core (services/worker/step_trace.py)",
                 "a directory: every engine step's shape and time, one JSON line each "
                 "(kvfleet sim calibrate --in-fleet)")
# -- the fault suite's injections (tests/faults/)
FAULT_ENGINE_STEP = Var("KVFLEET_FAULT_ENGINE_STEP", "an engine core (services/worker/faults.py)",
                        "N: the engine's N-th step raises (a crashed core)")
FAULT_ENGINE_SLOW_STEP = Var("KVFLEET_FAULT_ENGINE_SLOW_STEP", "an engine core (faults.py)",
                             "N:S: the engine's N-th step takes S seconds (a stalled core)")
FAULT_ENGINE_STEP_DELAY = Var("KVFLEET_FAULT_ENGINE_STEP_DELAY", "an engine core (faults.py)",
                              "S: every step of the engine takes S seconds more (a slower core)")
# -- Kubernetes' and Ray's own, read or set by `kvfleet rebalance --target kubernetes` / `up --ray`
KUBERNETES_SERVICE_HOST = Var("KUBERNETES_SERVICE_HOST", "rebalance --target kubernetes "
                              "(services/planner/rebalance_k8s.py)",
                              "set in a pod: the API server's address (in-cluster credentials)")
KUBERNETES_SERVICE_PORT = Var("KUBERNETES_SERVICE_PORT", "rebalance_k8s.py",
                              "the API server's port in a pod (443 when unset)")
KUBECONFIG = Var("KUBECONFIG", "rebalance_k8s.py",
                 "the kubeconfig outside a pod (its first path; else ~/.kube/config)")
RAY_LOOPBACK = Var("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "Ray, under `kvfleet up --ray` (set to 0 "
                   "by services/cli/ray_fleet.py)",
                   "0: Ray advertises and listens on 127.0.0.1, not the external interface")
# -- set for libraries, unless the operator set them
UCX_NET_DEVICES = Var("UCX_NET_DEVICES", "UCX, under NIXL (set by services/kv_transfer/nixl.py)",
                      "lo: UCX advertises loopback only")
NIXL_LOG_LEVEL = Var("NIXL_LOG_LEVEL", "NIXL (set by nixl.py)", "WARN: NIXL's INFO logs go to stdout")
TQDM_DISABLE = Var("TQDM_DISABLE", "tqdm, under the GGUF import (set by services/engine/"
                   "gguf_import.py)", "1: no progress bar in the converter's output")
XDG_CACHE_HOME = Var("XDG_CACHE_HOME", "a worker computing its quality version "
                     "(services/engine/quality_version.py)",
                     "where the cached digests of checkpoints' weight files live (else ~/.cache)")

TABLE: tuple[Var, ...] = tuple(v for v in globals().values() if isinstance(v, Var))
