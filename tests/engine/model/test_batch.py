"""prepare_inputs: one flat ragged batch from a mix of prefill chunks and decodes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.model import SeqChunk, prepare_inputs

BLOCK = 4


def test_hand_built_mix_of_prefill_and_decode():
    # seq0: 3 new tokens at start_pos 5 -> positions 5, 6, 7 (blocks: pos 0-3 -> 9, pos 4-7 -> 2)
    # seq1: a decode at start_pos 9     -> position 9        (pos 8-11 -> block 0)
    # seq2: a fresh 2-token prompt      -> positions 0, 1    (block 7)
    chunks = [
        SeqChunk([11, 12, 13], start_pos=5, block_table=[9, 2], logit_rows=(2,)),
        SeqChunk([21], start_pos=9, block_table=[5, 6, 0], logit_rows=(0,)),
        SeqChunk([31, 32], start_pos=0, block_table=[7], logit_rows=(0, 1)),
    ]
    b = prepare_inputs(chunks, BLOCK)

    assert b.token_ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert b.positions.tolist() == [5, 6, 7, 9, 0, 1]
    assert b.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 0 * 4 + 1, 7 * 4 + 0, 7 * 4 + 1]
    assert b.query_start_loc.tolist() == [0, 3, 4, 6]
    assert b.seq_lens.tolist() == [8, 10, 2]
    assert b.block_tables.tolist() == [[9, 2, 0], [5, 6, 0], [7, 0, 0]]
    assert b.logits_indices.tolist() == [2, 3, 4, 5]
    assert b.decode_rows.tolist() == [3]
    assert b.host.prefill_seqs.tolist() == [0, 2]
    assert b.host.max_seq_len == 10

    assert b.token_ids.dtype == b.positions.dtype == b.slot_mapping.dtype == b.logits_indices.dtype == torch.int64
    assert b.query_start_loc.dtype == b.seq_lens.dtype == b.block_tables.dtype == torch.int32


def test_chunk_straddling_blocks_maps_each_token_to_its_block():
    chunk = SeqChunk(list(range(6)), start_pos=2, block_table=[8, 3], logit_rows=())
    b = prepare_inputs([chunk], BLOCK)
    assert b.positions.tolist() == [2, 3, 4, 5, 6, 7]
    assert b.slot_mapping.tolist() == [34, 35, 12, 13, 14, 15]
    assert b.logits_indices.tolist() == []


@pytest.mark.parametrize("chunk, message", [
    (SeqChunk([], 0, [0], ()), "at least one token"),
    (SeqChunk([1, 2], 3, [0], ()), "cannot hold 5 positions"),
    (SeqChunk([1, 2], 0, [0], (2,)), "logit_rows out of range"),
    (SeqChunk([1], -1, [0], ()), "start_pos"),
])
def test_malformed_chunks_are_rejected(chunk, message):
    with pytest.raises(ValueError, match=message):
        prepare_inputs([chunk], BLOCK)


def test_a_full_batch_of_256_decodes_maps_every_row_as_the_per_token_loop():
    # The batch size a decode step reaches in the fleet; how fast it is prepared is a
    # benchmark's question, not a test's (no timed assertion here).
    chunks = [SeqChunk([i], 500 + i, list(range(i, i + 200)), (0,)) for i in range(256)]
    b = prepare_inputs(chunks, 16)
    positions, slots, logits = naive_prepare(chunks, 16)
    assert b.slot_mapping[5].item() == (5 + 505 // 16) * 16 + 505 % 16
    assert b.positions.tolist() == positions
    assert b.slot_mapping.tolist() == slots
    assert b.logits_indices.tolist() == logits


def naive_prepare(chunks, block_size):
    """The per-token loop prepare_inputs must agree with."""
    positions, slots, logits = [], [], []
    for chunk in chunks:
        for r in range(len(chunk.token_ids)):
            pos = chunk.start_pos + r
            positions.append(pos)
            slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
        logits += [len(positions) - len(chunk.token_ids) + r for r in chunk.logit_rows]
    return positions, slots, logits


@st.composite
def chunk_lists(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    chunks = []
    for _ in range(draw(st.integers(1, 6))):
        q = draw(st.integers(1, 40))
        start = draw(st.integers(0, 100))
        blocks = -(-(start + q) // block_size) + draw(st.integers(0, 2))
        table = draw(st.lists(st.integers(0, 500), min_size=blocks, max_size=blocks))
        rows = draw(st.lists(st.integers(0, q - 1), max_size=3))
        chunks.append(SeqChunk(list(range(q)), start, table, tuple(rows)))
    return chunks, block_size


@settings(max_examples=60, deadline=None)
@given(chunk_lists())
def test_vectorised_preparation_matches_a_per_token_loop(case):
    chunks, block_size = case
    b = prepare_inputs(chunks, block_size)
    positions, slots, logits = naive_prepare(chunks, block_size)
    assert b.positions.tolist() == positions
    assert b.slot_mapping.tolist() == slots
    assert b.logits_indices.tolist() == logits
