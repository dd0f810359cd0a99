"""What one request's hop costs between two processes: a unary call against one ask on a shared call
(services/protocol/shared_call.py), with the fleet token's interceptors on both, in turns.

    PYTHONPATH=. python -m loadtests.bench_shared_call [--calls 400] [--idle-ms 5]

A server process serves a stand-in router (named as such: Admit answers a fixed plan at once, so
what is timed is the transport), over `internal_channel` and the token guard as the fleet's
services do. The client alternates one unary Admit and one AdmitStream ask, each after
`--idle-ms` of idle (the fleet's lone requests come after idle too), and prints the median and
p90 round trip of each and the CPU ms per call of both processes (each phase run alone for the
CPU). Nothing is asserted; the figures go to docs/benchmarks.md ("Shared calls").
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import time

import grpc

from services.protocol import fleet_token, shared_call
from services.protocol.aio import internal_channel
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.protocol.typed_stub import TypedStub

TOKEN = "bench-" + "0" * 40


class InstantRouter(pb_grpc.RouterServicer):
    """A stand-in router: every Admit is answered at once with the same small plan."""

    async def Admit(self, request, context):
        return pb.Plan(request_id=request.request_id, mode=pb.Plan.COLOCATED,
                       prefill=[pb.WorkerRef(worker_id="mixed-0", address="127.0.0.1:1")])

    async def AdmitStream(self, asks, context):
        async for answer in shared_call.answer_asks(
                asks, lambda ask, ctx: self.Admit(ask.request, ctx), shared_call.ADMIT):
            yield answer


def serve(port_out, auth: fleet_token.FleetAuth) -> None:
    async def main():
        server = grpc.aio.server(interceptors=fleet_token.server_interceptors(auth))
        pb_grpc.add_RouterServicer_to_server(InstantRouter(), server)
        port_out.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()
    asyncio.run(main())


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(port: int, auth: fleet_token.FleetAuth, server_pid: int, calls: int,
              idle_s: float) -> dict:
    channel = internal_channel(f"127.0.0.1:{port}", auth)
    stub = TypedStub(pb_grpc.RouterStub(channel))
    shared = shared_call.admit_call(stub, f"127.0.0.1:{port}")
    n = iter(range(10 ** 9))

    async def unary():
        await stub.Admit(pb.WorkRequest(request_id=f"u{next(n)}"), timeout=5)

    async def ask():
        await shared_call.admit(shared, pb.WorkRequest(request_id=f"s{next(n)}"), 5.0)

    kinds = {"unary": unary, "shared": ask}
    for _ in range(20):                                  # warm-up: both paths open
        for call in kinds.values():
            await call()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(calls):
        for name, call in kinds.items():
            await asyncio.sleep(idle_s)
            t0 = time.perf_counter()
            await call()
            times[name].append(time.perf_counter() - t0)
    cpu = {}
    for name, call in kinds.items():                     # CPU: each alone, same idle
        me, peer = cpu_s(os.getpid()), cpu_s(server_pid)
        for _ in range(calls):
            await asyncio.sleep(idle_s)
            await call()
        cpu[name] = {"client": round(1e3 * (cpu_s(os.getpid()) - me) / calls, 3),
                     "server": round(1e3 * (cpu_s(server_pid) - peer) / calls, 3)}
    shared.close()
    await channel.close()
    q = lambda v, p: sorted(v)[int(p * (len(v) - 1))]  # noqa: E731
    return {name: {"median_ms": round(1e3 * statistics.median(v), 3),
                   "p90_ms": round(1e3 * q(v, 0.9), 3), "cpu_ms_per_call": cpu[name]}
            for name, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.bench_shared_call")
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--idle-ms", type=float, default=5.0)
    args = p.parse_args()
    auth = fleet_token.FleetAuth(TOKEN, False, "bench")
    spawn = multiprocessing.get_context("spawn")
    ports = spawn.Queue()
    server = spawn.Process(target=serve, args=(ports, auth), daemon=True)
    server.start()
    try:
        result = asyncio.run(run(ports.get(timeout=60), auth, server.pid, args.calls,
                                 args.idle_ms / 1e3))
    finally:
        server.terminate()
        server.join(10)
    print(json.dumps({"calls": args.calls, "idle_ms": args.idle_ms,
                      "load_1m": os.getloadavg()[0], **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
