"""Where a router or a worker may listen.

By default only on loopback (`LOOPBACK`): on one host the fleet talks over 127.0.0.1, and a
service that listened on another address would take calls from the network. A pod has no
loopback peer: the chart (helm/kvfleet) starts its routers and workers with `--host=$(POD_IP)
--allow-external-bind`, the explicit opt-in, and the NetworkPolicy and the fleet token guard them
there. With it, a worker's /metrics and its tcp KV receiver listen on the same host (Prometheus
scrapes the pod; a prefill worker on another node writes KV there). A Ray fleet spread over nodes
(`kvfleet up --ray ADDRESS --allow-external-bind`) starts each router and worker with its Ray
node's address and this flag (services/cli/ray_host.py).
"""
from __future__ import annotations

import argparse

from services.protocol.aio import LOOPBACK

FLAG = "--allow-external-bind"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(FLAG, action="store_true",
                   help="listen on a --host that is not loopback (a pod's IP); off by default")


def check(host: str, allow_external: bool, who: str) -> None:
    """SystemExit with one line unless `host` is loopback or the operator opted in."""
    if host not in LOOPBACK and not allow_external:
        raise SystemExit(f"{who} binds to loopback only unless {FLAG} is given; got --host {host}")


def metrics_host(host: str, allow_external: bool) -> str:
    """Where /metrics listens: beside the gRPC port when opted in, else 127.0.0.1."""
    return host if allow_external else "127.0.0.1"
