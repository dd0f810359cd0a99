"""The router's pool choice: the fallback pool only at S3 and up, only for a degradable request
(the gateway's word: its class may degrade, its tenant is not critical), only while the fallback
pool has every role the mode needs; and a plan never mixes pools."""
from __future__ import annotations

from hypothesis import given, strategies as st

from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.pools import FALLBACK, PRIMARY, choose_pool, in_pool, served_by

DISAGG = {"prefill", "decode"}


def worker(wid: str, role: str, pool: str = "", qv: str = "") -> pb.WorkerStats:
    return pb.WorkerStats(worker_id=wid, role=role, pool=pool, model=f"/m/{pool or 'primary'}",
                          quality_version=qv)


FLEET = [worker("prefill-0", "prefill"), worker("decode-0", "decode"),
         worker("fallback-prefill-0", "prefill", FALLBACK, "fp-small"),
         worker("fallback-decode-0", "decode", FALLBACK, "fp-small")]


def test_s3_sends_a_degradable_request_to_the_fallback_pool():
    assert choose_pool(FLEET, pb.S3_FALLBACK, True, DISAGG) == FALLBACK
    assert choose_pool(FLEET, pb.S4_REJECT, True, DISAGG) == FALLBACK


def test_below_s3_or_not_degradable_it_stays_on_the_primary():
    assert choose_pool(FLEET, pb.S2_CAP_OUTPUT, True, DISAGG) == PRIMARY
    assert choose_pool(FLEET, pb.S0_NORMAL, True, DISAGG) == PRIMARY
    assert choose_pool(FLEET, pb.S3_FALLBACK, False, DISAGG) == PRIMARY


def test_a_fallback_pool_missing_a_role_is_not_used():
    no_decode = FLEET[:3]
    assert choose_pool(no_decode, pb.S3_FALLBACK, True, DISAGG) == PRIMARY
    assert choose_pool(FLEET[:2], pb.S3_FALLBACK, True, DISAGG) == PRIMARY   # no fallback pool


def test_a_worker_that_names_no_pool_is_in_the_primary():
    assert [w.worker_id for w in in_pool(FLEET, PRIMARY)] == ["prefill-0", "decode-0"]


def test_the_plan_names_its_pool_model_and_quality_version():
    plan = pb.Plan(prefill=[pb.WorkerRef(worker_id="fallback-prefill-0")],
                   decode=pb.WorkerRef(worker_id="fallback-decode-0"))
    served_by(plan, in_pool(FLEET, FALLBACK), FALLBACK)
    assert (plan.pool, plan.model, plan.quality_version) == (FALLBACK, "/m/fallback", "fp-small")


@given(st.lists(st.tuples(st.sampled_from(["prefill", "decode", "mixed"]),
                          st.sampled_from(["", PRIMARY, FALLBACK])), max_size=12),
       st.integers(0, 4), st.booleans(), st.sampled_from([DISAGG, {"mixed"}]))
def test_placement_sees_one_pool_only(layout, stage, degradable, roles):
    workers = [worker(f"w{i}", role, pool) for i, (role, pool) in enumerate(layout)]
    pool = choose_pool(workers, stage, degradable, roles)
    chosen = in_pool(workers, pool)
    assert {w.pool or PRIMARY for w in chosen} <= {pool}
    if pool == FALLBACK:
        assert stage >= pb.S3_FALLBACK and degradable and roles <= {w.role for w in chosen}
