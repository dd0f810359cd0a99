"""KV transfer throughput per backend vs a torch memcpy of the same bytes.

    python -m services.cli.kv_bench [--mib 256] [--runs 5] [--backends memcpy,local,tcp,nixl]
                                         [--contiguous] [--json]

Moves --mib MiB of KV blocks (8 layers x K/V x 16 tokens x 8 kv heads x 128 dims, fp16: 512 KiB per block)
from a source pool into a target pool twice its size: shuffled, scattered block ids on both sides, like a
paged cache (--contiguous: one run of blocks on each side). tcp and nixl run the target in a second process
(peer.TargetProcess); local is in-process. A run is timed from write() until both the source's and the target's handles
are done; the first run per backend is a warm-up (connection set-up) and is checked with a crc32 of the
target's blocks. Reports the median GB/s (1 GB = 1e9 bytes). Not a test.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time

import torch

from services.protocol import fleet_token
from services.kv_transfer import make_transport
from services.kv_transfer.base import KVLayout, blocks_checksum
from services.kv_transfer.peer import TargetProcess, make_cache

LAYOUT = KVLayout(num_layers=8, block_size=16, kv_heads=8, head_dim=128, dtype="float16")


def bench_memcpy(nbytes: int, runs: int) -> list[float]:
    src, dst = torch.empty(nbytes, dtype=torch.uint8).random_(), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


def bench_transport(backend: str, n: int, runs: int, contiguous: bool = False) -> list[float]:
    pool_blocks = 2 * n
    source_kv = make_cache(LAYOUT, pool_blocks)
    source_kv.data.uniform_(-1, 1)
    source = make_transport(backend, "bench-source")
    source.register(source_kv)
    target = (_LocalTarget(pool_blocks) if backend == "local" else
              TargetProcess(backend, LAYOUT, pool_blocks, worker_id="bench-target", start_timeout_s=120.0))
    rng = random.Random(0)
    try:
        times = []
        for run in range(runs + 1):
            src, dst = rng.sample(range(pool_blocks), n), rng.sample(range(pool_blocks), n)
            if contiguous:
                src, dst = list(range(n)), list(range(n, 2 * n))
            times.append(_one_run(source, target, f"run-{run}", src, dst))
            if run == 0 and target.call("checksum", dst, timeout_s=120.0) != blocks_checksum(source_kv.data, src):
                raise RuntimeError(f"{backend}: the target's blocks differ from the source's")
        return times[1:]
    finally:
        target.stop()
        source.close()


def _one_run(source, target, transfer_id: str, src: list[int], dst: list[int]) -> float:
    descriptor = target.descriptor(dst)
    target.call("expect", transfer_id, dst, 120.0)
    t0 = time.perf_counter()
    source.write(transfer_id, src, descriptor, 120.0).wait(120.0)
    status, error = target.call("wait", transfer_id, 120.0, timeout_s=130.0)
    elapsed = time.perf_counter() - t0
    if status != "ok":
        raise RuntimeError(f"target failed: {error}")
    return elapsed


class _LocalTarget:
    """TargetProcess's surface over an in-process transport, for the local backend."""

    def __init__(self, pool_blocks: int):
        self.kv = make_cache(LAYOUT, pool_blocks)
        self.transport = make_transport("local", "bench-target")
        self.transport.register(self.kv)
        self.handles = {}

    def descriptor(self, block_ids):
        return self.transport.descriptor(block_ids)

    def call(self, command, *args, timeout_s=60.0):
        if command == "expect":
            self.handles[args[0]] = self.transport.expect(*args)
            return "ok"
        if command == "wait":
            self.handles.pop(args[0]).wait(args[1])
            return "ok", None
        if command == "checksum":
            return blocks_checksum(self.kv.data, args[0])
        raise ValueError(command)

    def stop(self):
        self.transport.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backends", default="memcpy,local,tcp,nixl")
    parser.add_argument("--contiguous", action="store_true", help="one run of blocks instead of scattered ones")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.update(fleet_token.child_env())   # the tcp target (spawned) and source share one token
    n = max(1, args.mib * (1 << 20) // LAYOUT.bytes_per_block)
    nbytes = n * LAYOUT.bytes_per_block
    results = {}
    for backend in args.backends.split(","):
        times = (bench_memcpy(nbytes, args.runs) if backend == "memcpy" else
                 bench_transport(backend, n, args.runs, args.contiguous))
        results[backend] = {"gbps_median": nbytes / statistics.median(times) / 1e9,
                            "ms_median": 1e3 * statistics.median(times), "runs": len(times)}
    blocks = "contiguous" if args.contiguous else "scattered"
    report = {"bytes": nbytes, "blocks": n, "block_order": blocks, "layout": dataclasses.asdict(LAYOUT),
              "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{nbytes / (1 << 20):.0f} MiB = {n} {blocks} blocks of {LAYOUT.bytes_per_block >> 10} KiB "
          f"({LAYOUT}), median of {args.runs}")
    for backend, r in results.items():
        print(f"  {backend:7s} {r['gbps_median']:6.2f} GB/s  {r['ms_median']:8.1f} ms")


if __name__ == "__main__":
    main()
