"""n > 1 (vLLM's parallel sampling) in the engine: the samples fork at the first token and share
the prompt's full KV blocks (ref-counted), each with its own copy of a partial last prompt block;
the reservation counts the prompt once. Seeds follow vLLM's rule (sample i: seed + i)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.engine.admission import blocks_for_samples, cdiv
from services.engine.engine import LLMEngine, engine_config
from services.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import export_kv, import_kv

GREEDY = dict(temperature=0.0, ignore_eos=True)
BLOCK = 4


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(engine_config(str(tiny_model_dir), token_budget=64, chunk_size=16,
                                   max_running=32, kv_cache_mib=16, block_size=BLOCK,
                                   reject_late=False))


def samples_of(outs, rid):
    """Per sample index: its tokens, and its finish reason."""
    got: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    for o in outs:
        if o.request_id == rid:
            got.setdefault(o.index, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                reasons[o.index] = o.finish_reason
    return got, reasons


def test_greedy_samples_are_identical_and_finish_once(engine):
    rid = engine.add_request("Three greedy samples of one prompt",
                             SamplingParams(max_tokens=8, n=3, **GREEDY))
    outs = list(engine.stream())
    got, reasons = samples_of(outs, rid)
    assert sorted(got) == [0, 1, 2]
    assert got[0] == got[1] == got[2] and len(got[0]) == 8
    assert reasons == {0: "length", 1: "length", 2: "length"}
    ends = [o.finished for o in outs if o.request_id == rid]
    assert ends[-1] and not any(ends[:-1])           # the request ends once, with its last sample
    assert engine.pool.num_used == 0 and engine.pool.num_reserved == 0
    engine.pool.check_invariants()


def test_seeded_sample_i_equals_one_request_with_seed_plus_i(engine):
    """vLLM's ParentRequest: child i samples with seed + i."""
    prompt = "Seeded samples differ from each other"
    p = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    outs = engine.generate([prompt] * 4, [SamplingParams(n=3, seed=77, **p)]
                           + [SamplingParams(seed=77 + i, **p) for i in range(3)])
    samples, alone = outs[:3], outs[3:]
    assert [o.index for o in samples] == [0, 1, 2]
    for i, out in enumerate(samples):
        assert out.token_ids == alone[i].token_ids
    assert len({tuple(o.token_ids) for o in samples}) > 1


def test_samples_share_the_prompts_full_blocks_while_they_run(engine):
    """A 10-token prompt on 4-token blocks: blocks 0-1 are full (shared, ref count 3), block 2
    holds 2 tokens (each sample has its own copy). The reservation: 2 shared + 3 x own."""
    pool = engine.pool
    ids = list(range(100, 110))
    params = SamplingParams(max_tokens=6, n=3, **GREEDY)
    rid = engine.add_request(ids, params, request_id="share")
    need = blocks_for_samples(10, 16, 3, BLOCK)
    assert need == 2 + 3 * (cdiv(16, BLOCK) - 2) == 8
    outs = engine.step()                       # the whole prompt, then the fork
    assert {o.index for o in outs if o.request_id == rid} == {0, 1, 2}
    tables = [pool.block_table(r) for r in (rid, f"{rid}#1", f"{rid}#2")]
    shared = tables[0][:2]
    assert all(t[:2] == shared for t in tables)
    assert all(pool.blocks[b].ref_count == 3 for b in shared)
    tails = {t[2] for t in tables}
    assert len(tails) == 3 and all(pool.blocks[b].ref_count == 1 for b in tails)
    held = len(set(b for t in tables for b in t))
    assert held + sum(pool.reserved(r) for r in (rid, f"{rid}#1", f"{rid}#2")) == need
    # the copied tail holds the same KV as the original
    k = engine.kv_cache.read_blocks(sorted(tails))
    assert (k[:, :, 0, :2] == k[:, :, 1, :2]).all() and (k[:, :, 0, :2] == k[:, :, 2, :2]).all()
    pool.check_invariants()
    list(engine.stream())
    assert pool.num_used == 0 and pool.num_reserved == 0
    pool.check_invariants()


def test_cancel_frees_every_sample_and_the_shared_blocks(engine):
    rid = engine.add_request(list(range(200, 213)), SamplingParams(max_tokens=30, n=4, **GREEDY))
    engine.step()
    engine.step()
    assert engine.pool.num_used > 0
    assert engine.cancel(rid)
    assert engine.pool.num_used == 0 and engine.pool.num_reserved == 0
    engine.pool.check_invariants()
    finals = [o for o in engine.step() if o.request_id == rid]
    assert sorted(o.index for o in finals) == [0, 1, 2, 3]
    assert {o.finish_reason for o in finals} == {"abort"}
    assert [o.finished for o in finals] == [False, False, False, True]
    assert not engine.cancel(rid)


def test_one_sample_cancelled_alone_frees_its_own_blocks_and_the_others_go_on(engine):
    """A sample ended by its index (the gateway matched a stop string in it): its own blocks and
    reservation go back at once, the shared prompt blocks stay for the others, which run to
    their length; the request ends once, with its last sample."""
    pool = engine.pool
    rid = engine.add_request(list(range(600, 610)), SamplingParams(max_tokens=12, n=3, **GREEDY))
    engine.step()
    engine.step()
    used, reserved = pool.num_used, pool.num_reserved
    own = set(pool.block_table(f"{rid}#1")) - set(pool.block_table(rid))
    assert engine.cancel(rid, sample=1)
    assert pool.num_used == used - len(own) and pool.num_reserved < reserved
    assert pool.reserved(f"{rid}#1") == 0
    pool.check_invariants()
    assert not engine.cancel(rid, sample=1)          # already ended
    assert not engine.cancel(rid, sample=3)          # no such sample
    outs = list(engine.stream())
    got, reasons = samples_of(outs, rid)
    assert reasons == {0: "length", 1: "abort", 2: "length"}
    assert len(got[0]) == len(got[2]) == 10          # 2 tokens came before the cancel
    ends = [o.finished for o in outs if o.request_id == rid]
    assert ends[-1] and not any(ends[:-1])
    assert pool.num_used == 0 and pool.num_reserved == 0
    pool.check_invariants()


def test_a_sample_cancelled_after_sample_0_ended_still_ends(engine):
    """Sample 0 (the request's own id) ended first; sample 1 is still found by its index."""
    rid = engine.add_request(list(range(620, 630)), SamplingParams(max_tokens=12, n=2, **GREEDY))
    engine.step()
    assert engine.cancel(rid, sample=0)
    engine.step()
    assert engine.cancel(rid, sample=1)
    outs = list(engine.stream())
    assert engine.pool.num_used == 0 and engine.pool.num_reserved == 0
    assert [o.finished for o in outs if o.request_id == rid][-1]
    assert not engine.has_unfinished()


def test_a_sample_cancelled_before_the_decode_role_forks_it_ends_as_it_forks(tiny_model_dir):
    """Decode role: the gateway may stop sample 1 on the first token the prefill worker sent,
    before the KV lands here. The sample ends (abort) when it forks; sample 0 decodes on."""
    params = SamplingParams(max_tokens=5, n=2, **GREEDY)
    ids = list(range(700, 710))
    decode = LLMEngine(engine_config(str(tiny_model_dir), role="decode", kv_cache_mib=16,
                                     block_size=BLOCK))
    assert decode.reserve_remote(ids, params, request_id="r")
    assert decode.cancel("r", sample=1)
    decode.start_decode("r", 5, [6])
    got, reasons = samples_of(list(decode.stream()), "r")
    assert reasons == {0: "length", 1: "abort"}
    assert len(got[0]) == 4 and got[1] == []
    assert decode.pool.num_used == 0 and decode.pool.num_reserved == 0
    decode.pool.check_invariants()


def test_a_repeated_prompt_reports_its_cached_tokens(engine):
    ids = list(range(300, 321))                      # 21 tokens: 5 full blocks
    (first,) = engine.generate([ids], SamplingParams(max_tokens=2, **GREEDY))
    (second,) = engine.generate([ids], SamplingParams(max_tokens=2, **GREEDY))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 20            # every full block (one token left to compute)


def test_prefill_and_decode_roles_fork_after_the_kv_lands(tiny_model_dir, engine):
    """The prefill worker samples the n first tokens; the decode worker reserves the prompt once
    plus n samples' own blocks, forks when the KV lands, and each sample continues from its own
    first token over the shared prompt KV exactly as a co-located request would."""
    params = SamplingParams(max_tokens=7, n=2, **GREEDY)
    ids = list(range(400, 414))                      # 14 tokens: 3 full blocks + 2
    (mixed, _) = engine.generate([ids], params)
    prefill = LLMEngine(engine_config(str(tiny_model_dir), role="prefill", kv_cache_mib=16,
                                      block_size=BLOCK))
    decode = LLMEngine(engine_config(str(tiny_model_dir), role="decode", kv_cache_mib=16,
                                     block_size=BLOCK))
    blocks = decode.reserve_remote(ids, params, request_id="r")
    assert len(blocks) == cdiv(14, BLOCK)
    assert decode.pool.num_reserved + len(blocks) == blocks_for_samples(14, 21, 2, BLOCK) == 3 + 2 * 3
    prefill.add_request(ids, params, request_id="r")
    firsts = list(prefill.stream())
    assert [(o.index, o.prefilled, o.finish_reason) for o in firsts] == [(0, True, None),
                                                                          (1, True, None)]
    assert firsts[-1].finished and firsts[0].block_ids
    assert firsts[0].new_token_ids == firsts[1].new_token_ids == mixed.token_ids[:1]
    kv = export_kv(prefill, "r")
    prefill.release("r")
    assert prefill.pool.num_used == 0
    other = 999                                      # sample 1 continues from another token
    (alone,) = engine.generate([ids + [other]], SamplingParams(max_tokens=6, **GREEDY))
    import_kv(decode, "r", kv, firsts[0].new_token_ids[0], [other])
    assert decode.pool.blocks[decode.pool.block_table("r")[0]].ref_count == 2
    decode.pool.check_invariants()
    got, _ = samples_of(list(decode.stream()), "r")
    assert firsts[0].new_token_ids + got[0] == mixed.token_ids
    assert got[1] == alone.token_ids
    assert decode.pool.num_used == 0 and decode.pool.num_reserved == 0
    decode.pool.check_invariants()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 19), st.integers(1, 9)),
                min_size=1, max_size=4),
       st.integers(0, 6), st.integers(0, 3), st.none() | st.integers(0, 3))
def test_no_block_leaks_whatever_n_lengths_and_cancel_points(engine, requests, cancel_at, victim,
                                                            sample):
    """Random requests (n, prompt length, max_tokens), one cancelled (whole, or one sample of
    it) after `cancel_at` steps: the pool's invariants hold after every step, and everything is
    free at the end."""
    pool = engine.pool
    rids = [engine.add_request(list(range(500 + i, 500 + i + length)),
                               SamplingParams(max_tokens=m, n=n, seed=i, ignore_eos=True))
            for i, (n, length, m) in enumerate(requests)]
    steps = 0
    while engine.has_unfinished():
        if steps == cancel_at:
            engine.cancel(rids[victim % len(rids)], sample)
            pool.check_invariants()
        engine.step()
        pool.check_invariants()
        steps += 1
    assert pool.num_used == 0 and pool.num_reserved == 0
    assert not engine._left and not engine._samples and not engine._doomed
