"""`python -m services.gateway --model DIR|tiny --router HOST:PORT --redis-url URL [options]`.

Prints `GRPC <host:port>` then `READY gateway <host:port>` (HTTP) once both servers listen;
SIGTERM / SIGINT stop it. Without --api-keys it serves unauthenticated, which it only does on a
loopback address unless --insecure is given: that check runs before anything is loaded or bound.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from services.gateway.config import (DEFAULT_DOCUMENT_THRESHOLD_TOKENS, DEFAULT_MAX_BODY_BYTES,
                                     DEFAULT_MAX_IN_PROGRESS, exposure_refusal)

from services.protocol import env
from services.protocol import timeouts
from services.protocol.shutdown import exit_now

METRICS_KEY_ENV = env.METRICS_KEY.name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvfleet gateway", description=__doc__)
    p.add_argument("--model", required=True, help="local HF checkpoint dir, or `tiny`")
    p.add_argument("--router", required=True,
                   help="host:port of a kvfleet Router, or several, comma-separated (any of "
                        "them may be asked: their state is in Redis)")
    p.add_argument("--redis-url", required=True, help="the fleet's Redis (tenant quotas)")
    p.add_argument("--api-keys", help="YAML list of keys (see services/gateway/config.py)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--grpc-port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--insecure", action="store_true",
                   help="allow unauthenticated access on a non-loopback address")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the names requests may use (vLLM's flag); responses carry the first. "
                        "Default: the model dir's name (`tiny` for tiny)")
    p.add_argument("--config", help="engine config YAML, as the workers use: traffic classes and "
                                    "max_model_len come from it")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--metrics-key-file", help=f"a file holding the bearer token GET /metrics then asks "
                   f"for (else ${METRICS_KEY_ENV}, else /metrics is open)")
    p.add_argument("--document-threshold-tokens", type=int,
                   default=DEFAULT_DOCUMENT_THRESHOLD_TOKENS,
                   help="keys of class `auto` (and requests without a key): prompts longer than "
                        "this many tokens are `document`, others interactive")
    p.add_argument("--job-deadline-s", type=float, default=3600.0,
                   help="an asynchronous job (Prefer: respond-async) not done by then fails")
    p.add_argument("--job-ttl-s", type=float, default=86400.0,
                   help="how long a finished job can still be read (GET /v1/jobs/{id})")
    p.add_argument("--job-lease-s", type=float, default=10.0,
                   help="a gateway renews its jobs' leases every third of this; the jobs of one "
                        "that died are taken over by another this long after its last renewal")
    p.add_argument("--max-in-progress", type=int, default=DEFAULT_MAX_IN_PROGRESS,
                   help="generation requests this gateway holds at once; past it, or past a "
                        "tenant's fair share of it, requests are refused at once (503 / 429 with "
                        "Retry-After; services/gateway/door.py). 0: no bound")
    p.add_argument("--quality-version", help="default: the checkpoint's dtype and config hash")
    timeouts.add_args(p)
    return p.parse_args(argv)


def build_config(args: argparse.Namespace):
    from services.engine.config import EngineConfig  # noqa: PLC0415
    from services.engine.config_file import load_engine_config  # noqa: PLC0415
    from services.gateway.config import GatewayConfig, load_api_keys  # noqa: PLC0415
    from services.gateway.model import resolve_model_dir  # noqa: PLC0415

    engine = load_engine_config(args.config) if args.config else EngineConfig()
    model_dir = resolve_model_dir(args.model)
    names = args.served_model_name or [os.path.basename(os.path.normpath(
        args.model if args.model == "tiny" or os.path.isdir(args.model) else model_dir))]
    return GatewayConfig(
        model_dir=model_dir, served_model_name=names[0], served_model_aliases=tuple(names[1:]),
        router=args.router, redis_url=args.redis_url,
        host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        api_keys=load_api_keys(args.api_keys) if args.api_keys else None, insecure=args.insecure,
        max_body_bytes=args.max_body_bytes, scheduler=engine.scheduler,
        max_model_len=engine.max_model_len, quality_version=args.quality_version,
        metrics_key=metrics_key(args.metrics_key_file),
        document_threshold_tokens=args.document_threshold_tokens,
        job_deadline_s=args.job_deadline_s, job_ttl_s=args.job_ttl_s,
        job_lease_s=args.job_lease_s, max_in_progress=args.max_in_progress)


def metrics_key(path: str | None) -> str | None:
    """The /metrics bearer token: the file's first line, else the environment's, else None."""
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    return env.METRICS_KEY.get() or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refusal = exposure_refusal(args.host, bool(args.api_keys), args.insecure)
    if refusal:
        print(f"kvfleet gateway: {refusal}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(message)s")
    if args.insecure and not args.api_keys:
        logging.warning("--insecure: serving WITHOUT authentication on %s", args.host)
    try:
        limits = timeouts.from_args(args)
        config = build_config(args)
    except SystemExit as e:
        print(f"kvfleet gateway: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:
        print(f"kvfleet gateway: {e}", file=sys.stderr)
        return 2
    from services.protocol.aio import run  # noqa: PLC0415
    from services.gateway.server import serve  # noqa: PLC0415
    return run(serve(config, limits))


if __name__ == "__main__":
    exit_now(main())                   # stopped and closed: no interpreter teardown
