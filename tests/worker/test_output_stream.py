"""A request's output stream on the worker: a reader that keeps up gets one message per engine
delta (one token per decode step, as vLLM streams); a reader far behind gets the backlog merged
into one message, so a slow client catches up instead of being sent every step."""
from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st

from services.engine.outputs import TokenOutput
from services.worker.engine_client import MERGE_BACKLOG, OutputStream


def delta(token: int, *, last: bool = False, index: int = 0) -> TokenOutput:
    return TokenOutput(request_id="r", new_token_ids=[token], new_logprobs=[], finished=last,
                       finish_reason="length" if last else None, num_output_tokens=token + 1,
                       index=index)


async def read_all(stream: OutputStream) -> list[TokenOutput]:
    return [out async for out in stream]


def test_a_reader_a_few_deltas_behind_still_gets_one_message_per_token():
    stream = OutputStream()
    for t in range(MERGE_BACKLOG - 1):
        stream.deliver(delta(t))
    stream.deliver(delta(MERGE_BACKLOG - 1, last=True))
    outs = asyncio.run(read_all(stream))
    assert [o.new_token_ids for o in outs] == [[t] for t in range(MERGE_BACKLOG)]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])


def test_a_reader_far_behind_gets_the_backlog_merged_in_order():
    stream = OutputStream()
    n = 3 * MERGE_BACKLOG
    for t in range(n - 1):
        stream.deliver(delta(t))
    stream.deliver(delta(n - 1, last=True))
    outs = asyncio.run(read_all(stream))
    assert len(outs) == 1
    assert outs[0].new_token_ids == list(range(n)) and outs[0].finished


@given(st.lists(st.integers(min_value=1, max_value=3 * MERGE_BACKLOG), min_size=1, max_size=8))
def test_whatever_the_reader_s_pace_every_token_arrives_once_in_order(bursts):
    """Deltas arrive in bursts between reads; the tokens read are the tokens sent."""
    async def run() -> list[int]:
        stream, read, token = OutputStream(), [], 0
        for i, burst in enumerate(bursts):
            for j in range(burst):
                stream.deliver(delta(token, last=i == len(bursts) - 1 and j == burst - 1))
                token += 1
            while stream._pending:
                out = await stream.next()
                assert len(out.new_token_ids) == 1 or burst > MERGE_BACKLOG
                read += out.new_token_ids
        return read
    assert asyncio.run(run()) == list(range(sum(bursts)))
