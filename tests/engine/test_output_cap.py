"""A request can never decode past its reservation: max_tokens beyond the class's output cap is
clamped to the cap (finish_reason "length" there), so the KV a `reserve`-policy request reserves,
prompt + min(max_tokens, cap), covers every token it can ever compute. Checked for co-located
(mixed) engines and for the decode role, whose reservation a prefill worker writes into.

The reproducer: `max_tokens` 2100 with `ignore_eos` against a 2048 cap killed the engine thread.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from services.engine.admission import cdiv
from services.engine.config import INTERACTIVE
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams

CAP = 12
CLASSES = (replace(INTERACTIVE, output_cap=CAP),)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    make = lambda role: LLMEngine(engine_config(  # noqa: E731
        str(tiny_model_dir), num_blocks=64, block_size=4, classes=CLASSES, role=role,
        reject_late=False))
    return {"mixed": make("mixed"), "decode": make("decode")}


def test_max_tokens_past_the_cap_ends_with_length_at_the_cap(engines):
    engine = engines["mixed"]
    [out] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=CAP + 50, temperature=0.0,
                                                        ignore_eos=True))
    assert len(out.token_ids) == CAP
    assert out.finish_reason == "length"
    assert engine.pool.num_used == 0 and engine.pool.num_reserved == 0


def run_checking_reservation(engine: LLMEngine, rids: list[str]) -> None:
    """Step to idle; at every step no request holds more blocks than it reserved up front."""
    reserved = {rid: engine.pool.held(rid) + engine.pool.reserved(rid) for rid in rids}
    while engine.has_unfinished():
        engine.step()
        for rid in rids:
            if rid in engine.scheduler.requests:
                reserved[rid] = reserved[rid] or engine.pool.held(rid) + engine.pool.reserved(rid)
                assert engine.pool.held(rid) <= reserved[rid]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.integers(1, 20), min_size=1, max_size=4),
       max_tokens=st.lists(st.integers(1, 3 * CAP), min_size=4, max_size=4),
       ignore_eos=st.booleans())
def test_decoding_never_outruns_the_reservation(engines, prompts, max_tokens, ignore_eos):
    for role, engine in engines.items():
        rids = []
        for i, n in enumerate(prompts):
            params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=ignore_eos)
            prompt = [10 + (7 * i + j) % 50 for j in range(n)]
            if role == "mixed":
                rids.append(engine.add_request(prompt, params))
                continue
            rid = f"remote-{i}"
            blocks = engine.reserve_remote(prompt, params, request_id=rid)
            assert blocks is not None and engine.pool.reserved(rid) + engine.pool.held(rid) == \
                cdiv(n + min(max_tokens[i], CAP), 4)
            engine.start_decode(rid, 11)        # the KV "landed"; the first token came with it
            rids.append(rid)
        run_checking_reservation(engine, rids)
        assert engine.pool.num_used == 0 and engine.pool.num_reserved == 0, role
