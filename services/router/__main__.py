"""`python -m services.router --redis-url URL [--mode disagg|colocated] [--port P]
[--router-id ID] [--timeout-*-s S ...] [--fleet-token-file PATH | --insecure-internal]`.

Several routers may serve one fleet: they keep nothing of their own that matters (all of it is in
Redis), so the gateway may ask any of them.

Serves only callers with the fleet token (services/protocol/fleet_token.py; without one it refuses
to start). Prints `READY router <host:port>` once serving; SIGTERM / SIGINT stop it."""
import argparse
import sys

import grpc

from services.protocol import fleet_token, timeouts
from services.protocol.aio import LOOPBACK, run, setup_logging

from services.state.fleet_state import FleetState
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.shutdown import wait_for_stop_signal
from services.router.service import RouterServicer


async def serve(args: argparse.Namespace) -> int:
    if args.host not in LOOPBACK:
        raise SystemExit(f"the router binds to loopback only in this build; got --host {args.host}")
    setup_logging("router")
    limits = timeouts.from_args(args)
    auth = fleet_token.configure(args, "router")
    state = FleetState(args.redis_url)
    servicer = RouterServicer(state, args.mode, args.router_id, limits)
    server = grpc.aio.server(interceptors=fleet_token.server_interceptors(auth))
    pb_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    print(f"READY router {args.host}:{port}", flush=True)
    await wait_for_stop_signal()
    await server.stop(grace=limits.shutdown_grace_s)
    await servicer.close()
    await state.close()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvfleet router")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--router-id", default="router")
    timeouts.add_args(p)
    fleet_token.add_args(p)
    return run(serve(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
