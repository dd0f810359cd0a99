"""`/metrics` for the processes that speak only gRPC (router, workers): prometheus_client's own
HTTP server, on a thread of its own, on loopback. The gateway serves its registry on its FastAPI
app instead (services/gateway/app.py)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server

from services.protocol.aio import LOOPBACK


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics on 127.0.0.1:PORT (0 picks a free port; -1: none)")


@dataclass
class MetricsServer:
    url: str                      # http://127.0.0.1:port/metrics
    _httpd: object

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve(registry: CollectorRegistry, port: int = 0, host: str = "127.0.0.1",
          external: bool = False) -> MetricsServer | None:
    """Serve `registry` at http://host:port/metrics; None when port is -1 (metrics off).
    `host` is loopback unless `external` (the service's --allow-external-bind)."""
    if port < 0:
        return None
    if host not in LOOPBACK and not external:
        raise ValueError(f"metrics bind to loopback only without --allow-external-bind; got {host}")
    httpd, _ = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(f"http://{host}:{httpd.server_port}/metrics", httpd)
