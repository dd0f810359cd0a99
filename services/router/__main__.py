"""`python -m services.router --redis-url URL [--mode disagg|colocated] [--port P]
[--fleet-token-file PATH | --insecure-internal]`.

Serves only callers with the fleet token (services/protocol/fleet_token.py; without one it refuses
to start). Prints `READY router <host:port>` once serving; SIGTERM / SIGINT stop it."""
import argparse
import sys

import grpc

from services.protocol import fleet_token
from services.protocol.aio import LOOPBACK, run, setup_logging

from services.state.fleet_state import FleetState
from services.protocol.mux import MuxListener
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.shutdown import wait_for_stop_signal
from services.router.service import RouterServicer


async def serve(args: argparse.Namespace) -> int:
    if args.host not in LOOPBACK:
        raise SystemExit(f"the router binds to loopback only in this build; got --host {args.host}")
    setup_logging("router")
    auth = fleet_token.configure(args, "router")
    state = FleetState(args.redis_url)
    servicer = RouterServicer(state, args.mode)
    server = grpc.aio.server(interceptors=fleet_token.server_interceptors(auth))
    pb_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    await server.start()
    mux = MuxListener(servicer.mux, auth)
    servicer.mux_address = await mux.start(args.host)
    print(f"READY router {args.host}:{port}", flush=True)
    await wait_for_stop_signal()
    await mux.close()
    await server.stop(grace=1.0)
    await servicer.close()
    await state.close()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvfleet router")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    fleet_token.add_args(p)
    return run(serve(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
