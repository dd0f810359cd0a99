"""The engine core in its own process, driven from asyncio through EngineClient: a real core per
test, started and stopped by the test. Tokens match the engine run in-process, errors come back
typed, the KV cache is one memory seen by both processes, and a core that dies (killed, or an
injected step fault) fails every stream and call at once.

The stories whose claim is about tokens, step statistics, KV bytes or a slow reader's merged
deltas run the tiny model's core (`config`); those about the boundary itself (cancels, typed
errors, a malformed command, a killed or failing core, an idle core's sleep and close) run the
simulated core (`sim`): the same engine_core process, commands, replies, scheduler and block
pool, with no torch to import and no weights to load."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import pytest
import torch

from services.engine.engine import LLMEngine, engine_config
from services.engine.errors import (DuplicateRequestError, EmptyPromptError, InvalidRequestError,
                                    UnknownRequestError)
from services.engine.sampling_params import SamplingParams
from services.worker.engine_client import EngineCallError, EngineClient, EngineFailed
from services.worker.engine_core import Done, StepStats
from services.worker.faults import ENGINE_STEP
from tests.engine.engine_helpers import export_kv
from tests.harness import sim_config

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
DEADLINE_S = 30.0    # every wait is bounded: a hang fails the test instead of stalling the suite
START_S = 120.0      # a core's start, bounded as well: the model's import and load on a loaded box


def config(model_dir, **overrides):
    return engine_config(str(model_dir), kv_cache_mib=16, **overrides)


def sim(model_dir, **overrides):
    """`config` on the simulated core: the tiny model's tokenizer and KV capacity, no weights."""
    return config(model_dir, sim=sim_config(16), **overrides)


def with_core(cfg, scenario, **client_kwargs):
    """Run `scenario(client)` against a started core; the core is always stopped afterwards."""
    async def main():
        client = EngineClient(cfg, **client_kwargs)
        await asyncio.wait_for(client.start(), START_S)
        try:
            return await scenario(client)
        finally:
            await client.close()
    return asyncio.run(main())


async def collect(stream) -> list:
    async def run():
        return [out async for out in stream]
    return await asyncio.wait_for(run(), DEADLINE_S)


def busy(stats) -> bool:
    """Something is queued, running or waiting for its KV: a request just added sits in the queue
    (num_running 0) until the core's next step admits it, so running alone is not idle."""
    return bool(stats.num_queued or stats.num_running or stats.num_waiting_for_kv)


async def until_idle(client: EngineClient) -> None:
    """Poll the core's stats until nothing is queued or runs (bounded by DEADLINE_S). The core
    sends a request's outputs before it answers a later stats call, so once it is idle every
    delta of a finished request has reached its stream."""
    deadline = time.monotonic() + DEADLINE_S
    while busy(await client.stats()):
        assert time.monotonic() < deadline, "the core never went idle"
        await asyncio.sleep(0.01)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.real_model("a stream's tokens equal the in-process engine's greedy tokens")
def test_a_stream_gets_the_same_tokens_as_the_engine_in_process(tiny_model_dir):
    expected = LLMEngine(config(tiny_model_dir)).generate([PROMPT], GREEDY)[0].token_ids

    async def scenario(client: EngineClient):
        stream = client.stream("r1")
        await client.add_request("r1", PROMPT, GREEDY, None, None)
        outs = await collect(stream)
        return outs, await client.stats()

    outs, stats = with_core(config(tiny_model_dir), scenario)
    assert [t for o in outs for t in o.new_token_ids] == list(expected)
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert stats.kv_blocks_used == 0 and stats.num_running == 0   # finished: pages freed


def test_a_slow_reader_gets_the_missed_deltas_merged(tiny_model_dir):
    async def scenario(client: EngineClient):
        stream = client.stream("r2")
        await client.add_request("r2", [5, 6, 7], GREEDY, None, None)
        await until_idle(client)                         # the core finishes meanwhile
        return await collect(stream)

    outs = with_core(config(tiny_model_dir), scenario)
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 12
    assert len(outs) == 1                                # one read, every delta merged


def test_cancel_frees_the_requests_pages_and_errors_come_back_typed(tiny_model_dir):
    async def scenario(client: EngineClient):
        stream = client.stream("long")
        await client.add_request("long", PROMPT, LONG, None, None)
        await asyncio.wait_for(stream.next(), DEADLINE_S)            # it is decoding
        held = (await client.stats()).kv_blocks_used
        was_live = await client.cancel("long")
        ended = await collect(stream)
        after = await client.stats()
        again = await client.cancel("long")
        with pytest.raises(EmptyPromptError) as empty:
            await client.add_request("empty", [], GREEDY, None, None)
        await client.add_request("dup", PROMPT, LONG, None, None)
        with pytest.raises(DuplicateRequestError):
            await client.add_request("dup", PROMPT, LONG, None, None)
        client.cancel_soon("dup")                        # fire-and-forget, answered by nobody
        with pytest.raises(UnknownRequestError):
            await client.start_decode("nobody", 7)
        await until_idle(client)                         # the cancel_soon landed
        return held, was_live, ended, after, again, empty.value

    held, was_live, ended, after, again, empty = with_core(sim(tiny_model_dir), scenario)
    assert held > 0 and was_live and not again
    assert ended[-1].finished and ended[-1].finish_reason == "abort"
    assert after.kv_blocks_used == 0 and after.num_running == 0
    assert isinstance(empty, InvalidRequestError) and empty.code == "empty_prompt" and empty.message


def test_one_sample_cancelled_alone_frees_its_blocks_while_the_others_run(tiny_model_dir):
    """Cancel with a sample index ends that sample of n: its own KV blocks go back at once, the
    others decode on, and the core sends text-free outputs (token ids and logprobs only)."""
    params = SamplingParams(max_tokens=40, n=2, temperature=0, ignore_eos=True)

    async def scenario(client: EngineClient):
        stream = client.stream("two")
        await client.add_request("two", PROMPT, params, None, None)
        first = await asyncio.wait_for(stream.next(), DEADLINE_S)       # forked: both decode
        both = (await client.stats()).kv_blocks_used
        was_live = await client.cancel("two", sample=1)
        one = (await client.stats()).kv_blocks_used
        rest = await collect(stream)
        return first, both, was_live, one, rest, await client.stats()

    first, both, was_live, one, rest, after = with_core(sim(tiny_model_dir), scenario)
    assert was_live and 0 < one < both
    assert not hasattr(first, "new_text")
    reasons = {o.index: o.finish_reason for o in [first, *rest] if o.finish_reason}
    assert reasons == {0: "length", 1: "abort"}
    assert sum(len(o.new_token_ids) for o in [first, *rest] if o.index == 0) == 40
    assert rest[-1].finished and after.kv_blocks_used == 0


def test_on_step_gets_every_steps_stats_and_the_first_token_its_times(tiny_model_dir):
    steps: list[StepStats] = []

    async def scenario(client: EngineClient):
        stream = client.stream("r3")
        await client.add_request("r3", PROMPT, GREEDY, None, None)
        outs = await collect(stream)
        seen_by_then = list(steps)             # on_step ran before the last outputs were routed
        long = client.stream("long")
        await client.add_request("long", PROMPT, LONG, None, None)
        await asyncio.wait_for(long.next(), DEADLINE_S)              # it is decoding
        stats = await client.stats()
        await client.cancel("long")
        return outs, seen_by_then, stats

    cfg = config(tiny_model_dir, token_budget=8, chunk_size=8, max_running=8)   # chunks 8, 8, 4
    outs, seen, stats = with_core(cfg, scenario, on_step=steps.append)
    assert all(isinstance(s, StepStats) for s in seen)
    assert [s.prefill_tokens for s in seen if s.prefill_tokens] == [8, 8, 4]   # no outputs for 2
    assert sum(s.decode_tokens for s in seen) == GREEDY.max_tokens - 1   # the prefill samples one
    assert all(s.duration_s >= 0 and s.gap_s >= 0 and s.preemptions == 0 for s in seen)
    decode_reads = [s.kv_read_bytes for s in seen if s.decode_tokens]
    assert decode_reads == sorted(decode_reads) and decode_reads[0] > 0    # the context grows
    first = next(o for o in outs if o.new_token_ids)
    assert first.queue_s is not None and first.queue_s >= 0 and first.prefill_s > 0
    assert all(o.queue_s is None for o in outs if o is not first)
    assert stats.oldest_queued_s == 0.0                                    # nothing waits
    (tenant, sequences, kv_blocks), = stats.tenants
    assert (tenant, sequences) == ("default", 1) and kv_blocks > 0


def test_an_on_step_that_raises_is_logged_and_the_outputs_still_arrive(tiny_model_dir, caplog):
    def broken(_: StepStats) -> None:
        raise RuntimeError("dashboard down")

    async def scenario(client: EngineClient):
        stream = client.stream("r4")
        await client.add_request("r4", PROMPT, GREEDY, None, None)
        return await collect(stream)

    outs = with_core(sim(tiny_model_dir), scenario, on_step=broken)
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 12
    assert "on_step failed" in caplog.text


class MalformedAdd(msgspec.Struct, tag=1, array_like=True):    # AddRequest's tag, bad fields
    call_id: int
    request_id: int


def test_a_command_that_does_not_decode_is_refused_and_the_core_goes_on(tiny_model_dir):
    async def scenario(client: EngineClient):
        with pytest.raises(EngineCallError, match="ValidationError"):
            await client._call(lambda cid: MalformedAdd(cid, 7), Done)
        return await client.stats()

    assert with_core(sim(tiny_model_dir), scenario).kv_blocks_used == 0


@pytest.mark.real_model("the KV the server reads equals the in-process engine's")
def test_the_prefill_cores_kv_is_read_by_the_server_from_the_same_memory(tiny_model_dir):
    """Core -> server: the prefill role keeps the prompt's KV after its prefilled output; the server reads
    those blocks straight from its view of the cache (what the KV senders do)."""
    ref = LLMEngine(config(tiny_model_dir, role="prefill"))
    ref.add_request(PROMPT, GREEDY, request_id="p")
    ref_first = [o for o in ref.stream() if o.request_id == "p"][-1].new_token_ids
    ref_kv = export_kv(ref, "p")

    async def scenario(client: EngineClient):
        stream = client.stream("p")
        await client.add_request("p", PROMPT, GREEDY, None, None)
        outs = await collect(stream)
        blocks = outs[-1].block_ids[:ref_kv.shape[2]]   # named with the first token
        return outs, client.kv_cache.read_blocks(blocks)

    outs, kv = with_core(config(tiny_model_dir, role="prefill"), scenario)
    assert outs[-1].prefilled and outs[-1].new_token_ids == ref_first
    assert kv.abs().sum() > 0 and torch.allclose(kv, ref_kv, atol=1e-5)


@pytest.mark.real_model("decoding from written KV gives the in-process engine's tokens")
def test_kv_the_server_writes_is_what_the_decode_core_attends_to(tiny_model_dir):
    """Server -> core: the decode role reserves blocks, the server writes the prompt's KV into
    them (as a KV receiver does) and the core decodes from it: the same tokens as the prompt run
    in one engine. With no KV written the continuation differs."""
    expected = LLMEngine(config(tiny_model_dir)).generate([PROMPT], GREEDY)[0].token_ids
    prefill = LLMEngine(config(tiny_model_dir, role="prefill"))
    prefill.add_request(PROMPT, GREEDY, request_id="d")
    first = [o for o in prefill.stream() if o.request_id == "d"][-1].new_token_ids[0]
    kv = export_kv(prefill, "d")

    async def decode(client: EngineClient, rid: str, write: bool) -> list[int]:
        blocks = await client.reserve(rid, PROMPT, GREEDY, None, None)
        if write:
            client.kv_cache.write_blocks(blocks[:kv.shape[2]], kv)
        stream = client.stream(rid)
        await client.start_decode(rid, first)
        return [t for o in await collect(stream) for t in o.new_token_ids]

    async def scenario(client: EngineClient):
        zeros = await decode(client, "d0", False)        # first: the cache is still all zeros
        return await decode(client, "d", True), zeros

    written, zeros = with_core(config(tiny_model_dir, role="decode",
                                      enable_prefix_caching=False), scenario)
    assert first == expected[0] and written == list(expected[1:])
    assert zeros != written


def test_killing_the_core_fails_every_stream_and_call_and_reports_once(tiny_model_dir):
    reported: list[EngineFailed] = []

    async def scenario(client: EngineClient):
        streams = [client.stream(f"k{i}") for i in range(3)]
        for i in range(3):
            await client.add_request(f"k{i}", PROMPT, LONG, None, None)
        for stream in streams:
            await asyncio.wait_for(stream.next(), DEADLINE_S)       # all three are decoding
        os.kill(client.pid, signal.SIGKILL)
        pending = asyncio.create_task(client.stats())    # sent before the death is noticed
        for stream in streams:
            with pytest.raises(EngineFailed, match="killed by signal 9"):
                await collect(stream)
        with pytest.raises(EngineFailed):
            await asyncio.wait_for(pending, DEADLINE_S)
        with pytest.raises(EngineFailed):
            await client.cancel("k0")                    # later calls fail at once
        late = client.stream("late")                     # a stream opened after the death too
        with pytest.raises(EngineFailed):
            await asyncio.wait_for(late.next(), DEADLINE_S)
        client.cancel_soon("k1")                         # a no-op, never an error
        return client.failure

    failure = with_core(sim(tiny_model_dir), scenario, on_failure=reported.append)
    assert isinstance(failure, EngineFailed) and reported == [failure]


def test_an_injected_step_fault_surfaces_as_engine_failed_naming_it(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(ENGINE_STEP, "3")                 # the core inherits the environment
    reported: list[EngineFailed] = []

    async def scenario(client: EngineClient):
        stream = client.stream("f")
        await client.add_request("f", PROMPT, GREEDY, None, None)
        with pytest.raises(EngineFailed, match=r"InjectedFault: injected failure at engine step 3"):
            await collect(stream)
        return client.failure, client.pid

    failure, pid = with_core(sim(tiny_model_dir), scenario, on_failure=reported.append)
    assert reported == [failure] and "Traceback" in failure.core_traceback
    assert gone(pid)


def test_a_core_that_fails_to_start_raises_and_leaves_nothing(tmp_path):
    client = EngineClient(engine_config(str(tmp_path / "no-such-model")))

    async def main():
        with pytest.raises(EngineFailed, match="the engine core failed"):
            await asyncio.wait_for(client.start(), DEADLINE_S)
    asyncio.run(main())
    assert gone(client.pid)


def test_an_idle_core_sleeps_and_close_leaves_no_process(tiny_model_dir):
    async def scenario(client: EngineClient):
        await client.stats()
        cpu = _cpu_s(client.pid)
        await asyncio.sleep(0.5)                         # measuring: an idle core uses no CPU
        idle_cpu = _cpu_s(client.pid) - cpu
        stream = client.stream("open")
        await client.add_request("open", PROMPT, LONG, None, None)
        t0 = time.monotonic()
        await client.close()
        closed_in = time.monotonic() - t0
        with pytest.raises(EngineFailed):
            await collect(stream)                        # a stream open at close ends
        await client.close()                             # idempotent
        return idle_cpu, closed_in, client.pid

    reported = []
    idle_cpu, closed_in, pid = with_core(sim(tiny_model_dir), scenario,
                                         on_failure=reported.append)
    assert idle_cpu < 0.05 and closed_in < 2.0
    assert gone(pid) and reported == []                  # closing is not a failure


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
