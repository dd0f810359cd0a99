"""The admission policy, read as rules (services/router/admission.py): what each stage does to a
request, who is protected, the headroom kept for them, and how long a miss may wait."""
from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from services.engine.config import BATCH, DOCUMENT, INTERACTIVE, Tenant
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.timeouts import Timeouts
from services.router import admission
from services.router.admission import AdmissionConfig, stage_rule
from services.router.predict import Prediction
from services.router.stages import S0, S1, S2, S3, S4
from services.router.waiting import RETRY_MAX_S, RETRY_MIN_S, retry_after_s

CFG = AdmissionConfig(tenants=(Tenant("ops", critical=True), Tenant("acme", min_kv_blocks=100)),
                      s2_output_cap=128)


def test_each_stage_does_its_one_thing_to_unprotected_requests():
    assert stage_rule(CFG, S0, BATCH, False, 4096) == admission.StageRule()
    assert stage_rule(CFG, S1, BATCH, False, 4096).hold
    assert not stage_rule(CFG, S1, INTERACTIVE, False, 4096).hold
    capped = stage_rule(CFG, S2, INTERACTIVE, False, 4096)
    assert capped.output_cap == 128 and "capped" in capped.note
    assert stage_rule(CFG, S2, INTERACTIVE, False, 64).output_cap == 0    # already under the cap
    assert stage_rule(CFG, S2, DOCUMENT, False, 4096).output_cap == 0     # not degradable
    s3 = stage_rule(CFG, S3, INTERACTIVE, False, 4096)
    assert s3.output_cap == 128 and "without a fallback pool" in s3.note
    assert stage_rule(CFG, S4, DOCUMENT, False, 10).refuse


@given(stage=st.sampled_from([S0, S1, S2, S3, S4]),
       cls=st.sampled_from([INTERACTIVE, DOCUMENT, BATCH]),
       max_tokens=st.integers(1, 10_000))
def test_a_protected_request_is_never_held_capped_or_refused(stage, cls, max_tokens):
    assert stage_rule(CFG, stage, cls, True, max_tokens) == admission.StageRule()


def test_critical_tenants_and_tenants_under_their_guarantee_are_protected():
    held = {"acme": 90, "other": 5000}
    assert admission.protected(CFG.tenant("ops"), held, 10_000)
    assert admission.protected(CFG.tenant("acme"), held, 10)        # 100 with it: at its minimum
    assert not admission.protected(CFG.tenant("acme"), held, 11)    # borrowing past it
    assert not admission.protected(CFG.tenant("other"), held, 1)


def test_tenant_kv_is_summed_over_the_decode_pools_only():
    share = [pb.TenantShare(tenant="acme", kv_blocks=30)]
    workers = [pb.WorkerStats(role=role, tenants=share) for role in ("decode", "mixed", "prefill")]
    assert admission.tenant_kv(workers) == {"acme": 60}


def test_the_headroom_is_left_to_protected_requests():
    cfg = AdmissionConfig(headroom_kv_fraction=0.1, headroom_slot_fraction=0.0, max_running=8)
    w = pb.WorkerStats(kv_blocks_total=100)
    assert admission.fits_outside_headroom(cfg, w, free_blocks=30, running=0, blocks=20)
    assert not admission.fits_outside_headroom(cfg, w, free_blocks=30, running=0, blocks=21)
    slots = AdmissionConfig(headroom_kv_fraction=0.0, headroom_slot_fraction=0.25, max_running=8)
    # no KV kept: the Reserve decides the KV; the slots are still kept
    assert admission.fits_outside_headroom(slots, w, 0, running=5, blocks=1)
    assert not admission.fits_outside_headroom(slots, w, 0, running=6, blocks=1)


def test_a_miss_waits_while_its_best_case_can_still_make_the_target():
    # the best case is its own prefill: the KV transfer comes after the first token
    p = Prediction(wait_s=3.0, prefill_s=0.4, transfer_s=0.1, decode_wait_s=0.0)
    assert admission.best_case_s(p) == 0.4
    assert admission.wait_until(100.0, 1.0, p, bound_s=20.0) == 100.6     # the target bounds it
    assert admission.wait_until(100.0, 600.0, p, bound_s=20.0) == 120.0   # the call's bound does
    too_slow = Prediction(0.0, 2.0, 0.0, 0.0)
    assert admission.wait_until(100.0, 1.0, too_slow, 20.0) == 100.0      # no wait at all


@given(blocks=st.integers(0, 10_000), rate=st.floats(0, 1e6), queued=st.floats(0, 1e9),
       prefill_rate=st.floats(0, 1e6))
def test_a_retry_hint_comes_from_the_drain_rate_and_is_always_within_bounds(blocks, rate, queued,
                                                                             prefill_rate):
    s = retry_after_s(blocks, rate, queued, prefill_rate)
    assert RETRY_MIN_S <= s <= RETRY_MAX_S


def test_a_retry_hint_is_the_blocks_needed_at_the_measured_rate():
    assert retry_after_s(40, 10.0, 0, 0) == 4.0
    assert retry_after_s(40, 0.0, 6000, 2000) == 3.0      # nothing freed yet: the prefill backlog


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan")])
def test_a_tenant_without_a_positive_weight_is_refused_with_its_name(weight):
    with pytest.raises(ValueError, match="tenant weights must be > 0: acme"):
        AdmissionConfig(tenants=(Tenant("fine"), Tenant("acme", weight=weight)))


def test_a_router_started_with_a_zero_weight_tenant_exits_naming_the_file_and_tenant(tmp_path):
    from services.router.__main__ import admission_config
    config = tmp_path / "engine.yaml"
    config.write_text("scheduler:\n  tenants:\n"
                      "    - {name: default}\n    - {name: acme, weight: 0}\n")
    with pytest.raises(SystemExit, match=f"{config}: tenant weights must be > 0: acme"):
        admission_config(str(config))


def test_the_kv_may_take_one_writes_limit_within_what_the_reservation_leaves_after_its_prefill():
    # a chat's reservation waits 30 + 4 x 1 s; less the 1-s margin and its first token (its
    # own prefill at the soonest): ~33 s, so the write's own 30 s bounds it
    p = Prediction(wait_s=5.0, prefill_s=0.5, transfer_s=4.0, decode_wait_s=0.0)
    assert admission.kv_write_limit_s(Timeouts(), 1.0, p) == 30.0
    short = Timeouts(reservation_s=5.0, reservation_per_target=0.0, kv_deadline_margin_s=1.0)
    assert admission.kv_write_limit_s(short, 1.0, p) == 3.5     # 5 - 1 - 0.5: the reservation's
    # a class whose target is longer than any reservation (batch: minutes) still has its 30 s
    assert admission.kv_write_limit_s(Timeouts(), 600.0, p) == 30.0
    assert "predicted 4 s to move the KV vs the 3.5 s" in admission.explain_transfer(p, 3.5, "S0")
