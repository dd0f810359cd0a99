"""Decode steps at fixed batch sizes, replayed as CUDA graphs (vLLM's pattern; `--cuda-graphs`).

A step whose every sequence decodes one token (the steady state of a decode worker) is padded to
the next captured size (1, 2, 4, ..., up to the scheduler's max_running) and run through static
buffers whose addresses never change:

    static buffers [max size]   token_ids  positions  slot_mapping  seq_lens  block_tables
    rows 0..n-1                 the step's sequences, as prepare_inputs lays them out
    rows n..p-1 (padding)       token 0 at position 0, slot -1 (nothing written to the KV cache),
                                context 1 (block 0's first slot, finite like every cache slot)

On CUDA with the Triton backend each size's forward is captured once at start (largest first,
one memory pool) and a step is: copy the inputs into the buffers, replay, read logits rows
0..n-1. Elsewhere the same padded forward runs eagerly through the same buffers, so a CPU test
proves the padding and the buffers (the torch backend's decode gathers each step's contexts at
shapes of that step, which a graph cannot replay; capturing it would pad every context to
max_model_len). Steps with a prefill chunk, more sequences than the largest size, or a context
past max_model_len run eagerly on the wrapped ModelRunner.

Padded rows never reach the KV cache: the Triton store skips a slot < 0, and the torch path
rewrites one slot no real row writes this step with the value it already holds (`pad_slot`).
A capture that fails leaves the engine serving every step on the wrapped runner (`capture_error`,
logged once), as with --cuda-graphs off.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from services.engine.model.attention import DecodeGroup, TorchAttentionBackend, TorchAttentionMetadata
from services.engine.model.batch import BatchInputs, HostBatch, SeqChunk, prepare_inputs
from services.engine.model.layers import fused_kernels
from services.engine.model.runner import ModelRunner

log = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512        # vLLM's largest default capture size
PAD_SLOT = -1                 # vLLM's PAD_SLOT_ID: the Triton store skips it


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the first power of two >= max_batch (at most MAX_CAPTURE_SIZE)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [1]
    while sizes[-1] < min(max_batch, MAX_CAPTURE_SIZE):
        sizes.append(2 * sizes[-1])
    return tuple(sizes)


@dataclass(frozen=True)
class DecodeGraphConfig:
    max_batch: int                # the scheduler's max_running: the largest size needed
    max_model_len: int            # the longest context a padded step serves
    capture: bool                 # CUDA graphs (else the same padded steps, eagerly)

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_model_len < 1:
            raise ValueError(f"need max_batch >= 1 and max_model_len >= 1 (got {self.max_batch}, "
                             f"{self.max_model_len})")


class StaticDecodeInputs:
    """The device buffers every padded decode step reads; a captured graph holds their addresses."""

    def __init__(self, max_size: int, max_blocks: int, device: torch.device):
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)
        self.token_ids, self.positions = zeros(max_size), zeros(max_size)
        self.slot_mapping = torch.full((max_size,), PAD_SLOT, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self.block_tables = zeros(max_size, max_blocks, dtype=torch.int32)
        self.pad_slot = zeros(1)               # the torch path's write target for padded rows
        self.max_blocks = max_blocks

    def fill(self, batch: BatchInputs, size: int) -> int:
        """The step's n rows, then padding up to `size` -> the block-table columns written (enough
        for the step's longest context; later columns of a row are never read)."""
        n, host = batch.token_ids.numel(), batch.host
        width = min(host.block_tables.shape[1], self.max_blocks)
        tables = np.zeros((size, width), np.int32)
        tables[:n] = host.block_tables[:, :width]
        slots = _padded(batch.slot_mapping.numpy(), size, PAD_SLOT)
        for buf, values in ((self.token_ids, _padded(batch.token_ids.numpy(), size, 0)),
                            (self.positions, _padded(batch.positions.numpy(), size, 0)),
                            (self.slot_mapping, slots),
                            (self.seq_lens, _padded(host.seq_lens.astype(np.int32), size, 1)),
                            (self.pad_slot, np.array([_free_slot(slots[:n])]))):
            buf[:len(values)].copy_(torch.from_numpy(values))
        self.block_tables[:size, :width].copy_(torch.from_numpy(tables))
        return width


def _padded(values: np.ndarray, size: int, pad) -> np.ndarray:
    out = np.full(size, pad, dtype=values.dtype)
    out[:len(values)] = values
    return out


def _free_slot(slots: np.ndarray) -> int:
    """A slot none of `slots` is (the smallest: some slot in 0..n is free)."""
    return int(np.setdiff1d(np.arange(len(slots) + 1), slots)[0])


def decode_only(chunks: Sequence[SeqChunk]) -> bool:
    """Every chunk one token whose logits are wanted: a step a padded decode can run."""
    return all(len(c.token_ids) == 1 and list(c.logit_rows) == [0] for c in chunks)


class DecodeGraphRunner:
    """A ModelRunner whose decode-only steps run padded through static buffers (module
    docstring); everything else is the wrapped runner's."""

    def __init__(self, runner: ModelRunner, config: DecodeGraphConfig):
        self.runner = runner
        self.config = config
        self.sizes = capture_sizes(config.max_batch)
        kv = runner.kv_cache
        self.context_len = -(-config.max_model_len // kv.block_size) * kv.block_size
        self.static = StaticDecodeInputs(self.sizes[-1], self.context_len // kv.block_size,
                                         runner.model.device)
        self.torch_path = isinstance(runner.backend, TorchAttentionBackend)
        if config.capture and self.torch_path:
            raise ValueError("CUDA graphs need the triton attention backend (the torch backend's "
                             "decode shapes follow each step's contexts)")
        device = runner.model.device
        self._rows = {p: torch.arange(p, device=device) for p in self.sizes}
        self._starts = {p: torch.arange(p + 1, dtype=torch.int32, device=device) for p in self.sizes}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.last_prepare_s = 0.0
        self.padded_steps = 0          # steps that ran padded (replayed, or eagerly off CUDA)
        self.capture_error: str | None = None
        if config.capture:
            self._capture_or_stay_eager()

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """-> float32 logits, as ModelRunner.execute; a padded step's are a view of a static
        buffer, valid until the next execute."""
        size = self._size_for(chunks)
        if size is None:
            logits = self.runner.execute(chunks)
            self.last_prepare_s = self.runner.last_prepare_s
            return logits
        with torch.inference_mode():
            t0 = time.perf_counter()
            batch = prepare_inputs(chunks, self.runner.kv_cache.block_size)
            self.runner.check_ranges(batch)
            width = self.static.fill(batch, size)
            self.last_prepare_s = time.perf_counter() - t0
            self.padded_steps += 1
            if size in self._graphs:
                graph, logits = self._graphs[size]
                graph.replay()
            else:
                logits = self._forward(size, width)
            return logits[:len(chunks)]

    def _size_for(self, chunks: Sequence[SeqChunk]) -> int | None:
        """The padded size a step runs at, or None for an eager step."""
        if self.capture_error is not None or not chunks or len(chunks) > self.sizes[-1]:
            return None
        if not decode_only(chunks):
            return None
        if max(c.start_pos + 1 for c in chunks) > self.context_len:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, len(chunks))]

    def _forward(self, size: int, width: int) -> torch.Tensor:
        """The model over static rows 0..size-1 (what a graph captures; `width`: the block-table
        columns attention reads, all of them when capturing)."""
        s, runner = self.static, self.runner
        rows = self._rows[size]
        batch = BatchInputs(
            token_ids=s.token_ids[:size], positions=s.positions[:size],
            slot_mapping=s.slot_mapping[:size], query_start_loc=self._starts[size],
            seq_lens=s.seq_lens[:size], block_tables=s.block_tables[:size], logits_indices=rows,
            decode_rows=rows,
            host=_static_host(size, self.context_len))
        meta = self._metadata(size, width)
        with fused_kernels(runner.fused_layers):
            return runner.model(batch, runner.kv_cache, runner.backend, meta)

    def _metadata(self, size: int, width: int):
        s, kv, rows = self.static, self.runner.kv_cache, self._rows[size]
        if self.torch_path:
            span = torch.arange(width * kv.block_size, device=rows.device)
            mask = (span[None, :] < s.seq_lens[:size, None])[:, None, None, :]
            group = DecodeGroup(rows, s.block_tables[:size, :width].long(), mask)
            return TorchAttentionMetadata(num_tokens=size, slot_mapping=s.slot_mapping[:size],
                                          num_decodes=size, decode_groups=(group,), prefills=(),
                                          k_scale=kv.k_scale, v_scale=kv.v_scale,
                                          pad_slot=s.pad_slot)
        from services.engine.model.triton_backend import TritonAttentionMetadata  # noqa: PLC0415
        rows32 = rows.to(torch.int32)
        return TritonAttentionMetadata(
            slot_mapping=s.slot_mapping[:size],
            query_start_loc=self._starts[size],
            seq_lens=s.seq_lens[:size], block_tables=s.block_tables[:size], decode_rows=rows32,
            decode_seqs=rows32, max_decode_len=self.context_len,
            prefill_seqs=rows32[:0], max_prefill_q_len=0, k_scale=kv.k_scale, v_scale=kv.v_scale)

    def _capture_or_stay_eager(self) -> None:
        """Capture every size; if that fails, every step runs on the plain runner (unpadded, as
        with --cuda-graphs off), the failure logged once and kept in `capture_error`."""
        try:
            self._capture_all()
        except Exception as e:  # noqa: BLE001 - the engine still serves, eagerly, and says why
            self._graphs.clear()
            self.capture_error = f"{type(e).__name__}: {e}"
            log.warning("cuda graphs: capture failed, every step runs eagerly: %s",
                        self.capture_error, exc_info=True)

    def _capture_all(self) -> None:
        """Each size once, largest first, all in one memory pool (a smaller graph reuses the
        larger's scratch memory). The buffers hold padding only: capturing writes no KV."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        rotary = self.runner.model.rotary
        with torch.inference_mode():
            for size in reversed(self.sizes):
                warm = torch.cuda.Stream()           # warm-up on a side stream (torch's recipe):
                warm.wait_stream(torch.cuda.current_stream())   # Triton compiles, lazy inits run
                with torch.cuda.stream(warm):
                    self._forward(size, self.static.max_blocks)
                torch.cuda.current_stream().wait_stream(warm)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(size, self.static.max_blocks)
                self._graphs[size] = (graph, logits)
        # the graphs read the rotary tables captured above: a later step must never rebuild them
        if rotary.capacity < self.context_len:
            raise RuntimeError(f"rotary tables hold {rotary.capacity} positions, graphs need "
                               f"{self.context_len}")
        log.info("captured decode CUDA graphs for batch sizes %s in %.1f s",
                 ",".join(map(str, self.sizes)), time.perf_counter() - t0)


def _static_host(size: int, context_len: int) -> HostBatch:
    """What the model reads of a padded step's host side: max_seq_len, the rotary tables' bound."""
    empty = np.zeros(0, np.int64)
    return HostBatch(query_start_loc=np.arange(size + 1), seq_lens=empty,
                     block_tables=np.zeros((0, 0), np.int32), decode_seqs=np.arange(size),
                     prefill_seqs=empty, max_seq_len=context_len, max_token_id=0, max_block_id=0)
