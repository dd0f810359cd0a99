"""A target (decode-side) worker in its own process, driven over a Pipe: for the benchmark and two-process tests.

    with TargetProcess("tcp", layout, num_blocks=64) as target:     # spawns serve() in a fresh interpreter
        desc = target.descriptor([7, 3, 12])                         # a KVDescriptor, as it would come over gRPC
        target.call("expect", "req-1", [7, 3, 12], 10.0)
        source.write("req-1", [0, 1, 2], desc, 10.0, hand_off=h).wait(10.0)
        status, detail = target.call("wait", "req-1", 10.0)          # ("ok", serialized HandOff | None)
                                                                     # | ("error", message)

Commands (serve): descriptor, expect, wait, fill, pool (the whole pool's bytes), checksum, close.
"""
from __future__ import annotations

import multiprocessing
from typing import Sequence

import torch

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.engine.model.config import ModelConfig
from services.engine.model.kv_cache import KVCache, resolve_kv_dtype
from services.kv_transfer import make_transport
from services.kv_transfer.base import KVLayout, KVTransferError, blocks_checksum, byte_view


def make_cache(layout: KVLayout, num_blocks: int) -> KVCache:
    """An empty KVCache of this layout (the model config carries only what the cache needs)."""
    config = ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": 1, "hidden_size": layout.kv_heads * layout.head_dim,
        "intermediate_size": 1, "num_hidden_layers": layout.num_layers, "num_attention_heads": layout.kv_heads,
        "num_key_value_heads": layout.kv_heads, "head_dim": layout.head_dim, "max_position_embeddings": 1})
    return KVCache(config, num_blocks, layout.block_size, layout.dtype, k_scale=layout.k_scale,
                   v_scale=layout.v_scale)


def fill_random(kv: KVCache, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    kv.data.copy_(torch.randn(kv.data.shape, generator=generator).to(kv.dtype))


def pool_from_bytes(raw: bytes, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """Inverse of the 'pool' command: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
    shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.kv_heads, layout.head_dim)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(resolve_kv_dtype(layout.dtype)).view(shape)


def serve(conn, backend: str, layout: KVLayout, num_blocks: int, worker_id: str) -> None:
    """Child main: one pool, one transport, commands until 'close' or the parent goes away."""
    kv = make_cache(layout, num_blocks)
    transport = make_transport(backend, worker_id)
    handles = {}
    try:
        transport.register(kv)
        conn.send("ready")
        while True:
            command, *args = conn.recv()
            if command == "close":
                return
            if command == "descriptor":
                conn.send(transport.descriptor(args[0]).SerializeToString())
            elif command == "expect":
                handles[args[0]] = transport.expect(*args)
                conn.send("ok")
            elif command == "wait":
                conn.send(_wait(handles.pop(args[0]), args[1]))
            elif command == "fill":
                fill_random(kv, args[0])
                conn.send("ok")
            elif command == "pool":
                conn.send(bytes(byte_view(kv.data)))
            elif command == "checksum":
                conn.send(blocks_checksum(kv.data, args[0]))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        transport.close()
        conn.close()


def _wait(handle, timeout_s: float) -> tuple[str, bytes | str | None]:
    """-> ("ok", the hand-off serialized, or None) | ("error", why)."""
    try:
        handle.wait(timeout_s)
    except KVTransferError as e:
        return "error", str(e)
    return "ok", None if handle.hand_off is None else handle.hand_off.SerializeToString()


class TargetProcess:
    """Parent side of serve(): start, call with a timeout, always stopped (joined, else killed) on exit."""

    def __init__(self, backend: str, layout: KVLayout, num_blocks: int, worker_id: str = "target",
                 start_timeout_s: float = 30.0):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, backend, layout, num_blocks, worker_id),
                                   daemon=True)
        self.process.start()
        child.close()
        try:
            if self._recv(start_timeout_s) != "ready":
                raise RuntimeError("target process did not start")
        except BaseException:
            self.stop()
            raise

    def call(self, command: str, *args, timeout_s: float = 30.0):
        self._conn.send((command, *args))
        return self._recv(timeout_s)

    def descriptor(self, block_ids: Sequence[int]) -> pb.KVDescriptor:
        return pb.KVDescriptor.FromString(self.call("descriptor", list(block_ids)))

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=10)

    def stop(self) -> None:
        try:
            if self.process.is_alive():
                self._conn.send(("close",))
        except OSError:
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.kill()
        self._conn.close()

    def __enter__(self) -> TargetProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _recv(self, timeout_s: float):
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"target process gave no answer within {timeout_s}s")
        return self._conn.recv()
