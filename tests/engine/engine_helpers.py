"""Moving a prompt's KV between two in-process engines by hand, as no service does (workers move
it through a KV transport straight between pools): what the engine tests of disaggregation use."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.engine import LLMEngine
from services.engine.errors import UnknownRequestError
from services.engine.request import Status


def export_kv(engine: LLMEngine, request_id: str) -> torch.Tensor:
    """Prefill role: the prompt's KV ([layers, 2, n, block, kv_heads, head_dim]) of a prefilled
    request."""
    req = engine.scheduler.requests.get(request_id)
    if req is None or req.status != Status.PREFILLED:
        raise UnknownRequestError(f"{request_id} holds no prefilled KV")
    nblocks = -(-req.num_prompt_tokens // engine.pool.block_size)
    return engine.kv_cache.read_blocks(engine.pool.block_table(request_id)[:nblocks])


def import_kv(engine: LLMEngine, request_id: str, kv: torch.Tensor, first_token: int,
              more_first_tokens: Sequence[int] = ()) -> None:
    """Decode role: write the prompt's KV into the reserved blocks and start decoding from the
    prefill worker's first token(s)."""
    engine.kv_cache.write_blocks(engine.pool.block_table(request_id)[:kv.shape[2]], kv)
    engine.start_decode(request_id, first_token, more_first_tokens)
