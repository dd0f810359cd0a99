"""One iteration's work as a single flattened ragged batch.

The scheduler hands the runner one SeqChunk per scheduled sequence. prepare_inputs concatenates them
into flat token rows (decode tokens and prefill chunks alike; there is no separate decode phase):

    chunks      seq0: 3 new tokens at start_pos 5   seq1: 1 token at start_pos 9   seq2: 2 at 0
    rows        0 1 2 | 3 | 4 5                       T = 6, S = 3
    positions   5 6 7 | 9 | 0 1
    query_start_loc  [0, 3, 4, 6]      seq_lens [8, 10, 2]     (context after this step)
    slot_mapping[r] = block_table[pos // block_size] * block_size + pos % block_size

Everything is computed with numpy over whole arrays (one pass over the chunks, none over tokens).
Host-side numpy copies are kept beside the tensors so metadata building never syncs with a device.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import chain
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class SeqChunk:
    """What the scheduler asks the model to compute for one sequence this iteration."""

    token_ids: Sequence[int]    # the q new tokens (q >= 1)
    start_pos: int              # tokens already in the KV cache (positions 0..start_pos-1)
    block_table: Sequence[int]  # block ids covering positions [0, start_pos + q)
    logit_rows: Sequence[int]   # local rows 0..q-1 whose logits are wanted; () for none


@dataclass(frozen=True)
class HostBatch:
    query_start_loc: np.ndarray  # [S + 1] int64
    seq_lens: np.ndarray         # [S] int64
    block_tables: np.ndarray     # [S, max_blocks] int32
    decode_seqs: np.ndarray      # [S_d] int64  sequence indices with q_len == 1
    prefill_seqs: np.ndarray     # [S_p] int64  sequence indices with q_len > 1
    max_seq_len: int             # max(seq_lens): a bound on every position + 1
    max_token_id: int
    max_block_id: int


@dataclass
class BatchInputs:
    token_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64  block_id * block_size + offset
    query_start_loc: torch.Tensor  # [S + 1] int32  cu_seqlens_q
    seq_lens: torch.Tensor         # [S] int32  context length after this step
    block_tables: torch.Tensor     # [S, max_blocks] int32, padded with block 0
    logits_indices: torch.Tensor   # [R] int64  rows of the flat batch that get logits
    decode_rows: torch.Tensor      # [S_d] int64  rows of the sequences with q_len == 1
    host: HostBatch                # numpy copies, read by attention metadata builders without syncs

    def to(self, device: torch.device | str) -> BatchInputs:
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True)
                 for f in fields(self) if f.name != "host"}
        return replace(self, **moved)


def prepare_inputs(chunks: Sequence[SeqChunk], block_size: int) -> BatchInputs:
    if not chunks:
        raise ValueError("prepare_inputs needs at least one chunk")
    s = len(chunks)
    q_lens = _lengths(c.token_ids for c in chunks)
    starts = np.fromiter((c.start_pos for c in chunks), np.int64, s)
    table_lens = _lengths(c.block_table for c in chunks)
    row_counts = _lengths(c.logit_rows for c in chunks)
    seq_lens = starts + q_lens
    _validate(q_lens, starts, table_lens, seq_lens, block_size)

    cu = np.zeros(s + 1, np.int64)
    np.cumsum(q_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    seq_of_row = np.repeat(np.arange(s), q_lens)                               # [T]
    positions = np.arange(num_tokens) - np.repeat(cu[:-1] - starts, q_lens)    # [T]
    tables = _pad_tables(chunks, table_lens)                                   # [S, max_blocks]
    slots = tables[seq_of_row, positions // block_size].astype(np.int64) * block_size + positions % block_size
    logits_indices = _logits_indices(chunks, row_counts, q_lens, cu)
    token_ids = _flat(chain.from_iterable(c.token_ids for c in chunks), num_tokens)

    if token_ids.min() < 0:
        raise ValueError("token ids must be >= 0")
    is_decode = q_lens == 1
    host = HostBatch(
        query_start_loc=cu, seq_lens=seq_lens, block_tables=tables,
        decode_seqs=np.flatnonzero(is_decode), prefill_seqs=np.flatnonzero(~is_decode),
        max_seq_len=int(seq_lens.max()), max_token_id=int(token_ids.max()),
        max_block_id=int(tables.max()),
    )
    return BatchInputs(
        token_ids=torch.from_numpy(token_ids), positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots), query_start_loc=torch.from_numpy(cu.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)), block_tables=torch.from_numpy(tables),
        logits_indices=torch.from_numpy(logits_indices),
        decode_rows=torch.from_numpy(cu[:-1][is_decode]), host=host,
    )


def _lengths(seqs) -> np.ndarray:
    return np.fromiter((len(x) for x in seqs), np.int64)


def _flat(values, count: int) -> np.ndarray:
    return np.fromiter(values, np.int64, count)


def _validate(q_lens, starts, table_lens, seq_lens, block_size: int) -> None:
    if (q_lens < 1).any():
        raise ValueError(f"every chunk needs at least one token (got q lens {q_lens.tolist()})")
    if (starts < 0).any():
        raise ValueError(f"start_pos must be >= 0 (got {starts.tolist()})")
    short = np.flatnonzero(table_lens * block_size < seq_lens)
    if short.size:
        i = int(short[0])
        raise ValueError(f"chunk {i}: block_table of {table_lens[i]} blocks x {block_size} cannot hold "
                         f"{seq_lens[i]} positions")


def _pad_tables(chunks: Sequence[SeqChunk], table_lens: np.ndarray) -> np.ndarray:
    """Row-major boolean assignment fills each row's prefix in chunk order."""
    tables = np.zeros((len(chunks), max(int(table_lens.max()), 1)), np.int32)
    filled = np.arange(tables.shape[1])[None, :] < table_lens[:, None]
    tables[filled] = _flat(chain.from_iterable(c.block_table for c in chunks), int(table_lens.sum()))
    if (tables < 0).any():
        raise ValueError("block ids must be >= 0")
    return tables


def _logits_indices(chunks, row_counts: np.ndarray, q_lens: np.ndarray, cu: np.ndarray) -> np.ndarray:
    rows = _flat(chain.from_iterable(c.logit_rows for c in chunks), int(row_counts.sum()))
    bad = (rows < 0) | (rows >= np.repeat(q_lens, row_counts))
    if bad.any():
        raise ValueError(f"logit_rows out of range: {rows[bad].tolist()[:8]}")
    return rows + np.repeat(cu[:-1], row_counts)
