"""A cold fleet whose prior refuses everything still learns its pace.

A worker that has measured no step publishes its prior. When that prior is too pessimistic for
the class target (SmolLM2 on the 2-core CPU: every 200-token chat priced at 1.4 s against the
1-s target), refusing "when even the best case breaks the target" refused every request: the
worker never ran a step, never measured, and the fleet stayed cold forever. Now an idle worker
whose costs are still mostly its prior takes one request at a time as a probe, so that it
measures; once it has measured, the policy is the measured one again.

A co-located router behind a real gRPC server, over a real Redis holding the worker's beats (the
beats are scripted: what a worker publishes before and after its steps)."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtests.workload import load_workload
from services.engine.config import SimConfig
from services.engine.scheduler import attention_pairs
from services.planner.sim_admission import SimAdmissionConfig, policy_for
from services.planner.simulator import (Fleet, SimRunConfig, Simulation, kv_bytes_per_token_of,
                                        timing_of)
from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router import admission
from services.router.admission import AdmissionConfig
from services.router.predict import Prediction, predict
from services.state.fleet_state import FleetState
from services.worker.rates import SMOLLM2, WorkerRates
from tests.router.test_cold_burst import router_beside
from tests.waiting import eventually

CHAT = list(range(200))
SLOW = 6.3e-3          # s a token: the SmolLM2 default prior (1.4 s for a 200-token chat)
FAST = 1e-3            # s a token: the pace it measures (0.34 s for the same chat)


def beat(fit_steps: int, s_per_token: float, ratio: float = 0.0,
         running: int = 0) -> pb.WorkerStats:
    """The one mixed worker's beat: its published cost fit, how many steps it has seen and its
    price of its recent steps over what they took (`ratio`)."""
    return pb.WorkerStats(worker_id="mixed-0", role="mixed", kv_blocks_total=10_000,
                          kv_blocks_free=10_000, block_size=16, max_model_len=4096,
                          grpc_address="127.0.0.1:1", model="smollm2", kv_backend="local",
                          prefill_step_s=0.12, prefill_s_per_token=s_per_token,
                          prefill_s_per_pair=1e-6, prefill_fit_steps=fit_steps,
                          prefill_fit_ratio=ratio,
                          token_budget=512, chunk_size=256, num_running=running,
                          updated_at_unix_s=time.time())


def chat(rid: str) -> pb.WorkRequest:
    return pb.WorkRequest(request_id=rid, traffic_class="interactive", prompt_token_ids=CHAT,
                          params=pb.SamplingParams(max_tokens=8))


async def admit(router, rid: str) -> pb.Plan | str:
    """The plan, or the refusal's message."""
    try:
        return await router.Admit(chat(rid), timeout=30)
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return status.of(e).message


async def publish(redis_url: str, redis_ns: str, servicer, stats: pb.WorkerStats) -> None:
    """A new beat of the worker, and the router seeing it."""
    state = FleetState(redis_url, redis_ns)
    try:
        await state.heartbeat(stats, 60.0)
    finally:
        await state.close()

    async def seen() -> bool:
        return any(w.updated_at_unix_s == stats.updated_at_unix_s
                   for w in await servicer.live_workers())
    assert await eventually(seen)


def probes(servicer) -> float:
    return servicer.metrics.probes.labels("interactive")._value.get()


def test_the_prior_is_pessimistic_enough_to_refuse_every_chat():
    best = admission.best_case_s(predict(beat(0, SLOW), len(CHAT), traffic_class="interactive"))
    assert best > 1.0 > admission.best_case_s(
        predict(beat(8, FAST, 1.0), len(CHAT), traffic_class="interactive"))


def test_without_probes_a_cold_fleet_refuses_everything_and_never_measures(redis_url, redis_ns):
    """The hole, kept reproducible: probe_slack=1 is the policy before probes."""
    async def story():
        before = AdmissionConfig(probe_slack=1.0)
        async with router_beside(redis_url, redis_ns, beat(0, SLOW),
                                 policy=before) as (servicer, router):
            answers = [await admit(router, f"c{i}") for i in range(5)]
            assert all(isinstance(a, str) and a.startswith("prefill: predicted TTFT 1.4")
                       for a in answers), answers
            assert probes(servicer) == 0
    asyncio.run(story())


def test_an_idle_unmeasured_worker_takes_one_probe_then_decisions_follow_its_measurements(
        redis_url, redis_ns):
    async def story():
        async with router_beside(redis_url, redis_ns, beat(0, SLOW)) as (servicer, router):
            # the first chat goes as a probe, with its (pessimistic) prediction
            plan = await admit(router, "probe-1")
            assert isinstance(plan, pb.Plan) and plan.predicted_ttft_s > 1.0
            assert probes(servicer) == 1
            # while it is in flight, the next chat is refused as before (the probe queued ahead)
            second = await admit(router, "c1")
            assert isinstance(second, str) and second.startswith("prefill: predicted TTFT")
            # the worker measured the probe's step: its fit still mostly the prior (1.3 s a
            # chat), pricing the step it ran 4x slower than it ran: idle again, and not yet
            # measured, it takes the next probe
            await publish(redis_url, redis_ns, servicer, beat(1, 5.8e-3, ratio=4.0))
            assert isinstance(await admit(router, "probe-2"), pb.Plan)
            assert probes(servicer) == 2
            # a busy worker is not probed, even with its probe's step measured
            await publish(redis_url, redis_ns, servicer, beat(2, 5.4e-3, 3.0, running=1))
            busy = await admit(router, "c2")
            assert isinstance(busy, str) and busy.startswith("prefill:")
            # measured (its fit prices its steps as they ran) at a pace that meets the target:
            # admitted, not as a probe
            await publish(redis_url, redis_ns, servicer, beat(8, FAST, 1.1))
            plan = await admit(router, "c3")
            assert isinstance(plan, pb.Plan) and plan.predicted_ttft_s < 1.0
            assert probes(servicer) == 2
            # measured at a pace that breaks it: refused with the reason, and never probed
            await publish(redis_url, redis_ns, servicer, beat(9, SLOW, 1.0))
            refused = await admit(router, "c4")
            assert isinstance(refused, str) and refused.startswith("prefill: predicted TTFT 1.4")
            assert probes(servicer) == 2
    asyncio.run(story())


def test_a_burst_on_a_cold_worker_sends_one_probe(redis_url, redis_ns):
    async def story():
        async with router_beside(redis_url, redis_ns, beat(0, SLOW)) as (servicer, router):
            answers = await asyncio.gather(*(admit(router, f"b{i}") for i in range(8)))
            assert sum(isinstance(a, pb.Plan) for a in answers) == 1
            assert probes(servicer) == 1
    asyncio.run(story())


# ------------------------------------------------------------ the probe slots, as a property
HOPELESS = Prediction(wait_s=0.0, prefill_s=1.4, transfer_s=0.0, decode_wait_s=0.0)
FINE = Prediction(wait_s=0.0, prefill_s=0.3, transfer_s=0.0, decode_wait_s=0.0)
CFG = AdmissionConfig(probe_ratio=1.5, probe_hold_s=10.0)

events = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from(["w0", "w1"])),
    st.tuples(st.just("measured"), st.tuples(st.sampled_from(["w0", "w1"]),
                                             st.floats(0.5, 20.0))),
    st.tuples(st.just("wait"), st.floats(0.0, 4.0))), max_size=40)


@settings(max_examples=200, deadline=None)
@given(events)
def test_at_most_one_probe_is_in_flight_per_worker_whatever_the_arrival_order(script):
    """Probes taken on a worker since it last measured a step, within the hold: never two."""
    now = [0.0]
    slots = admission.Probes(CFG.probe_hold_s, clock=lambda: now[0])
    steps = {"w0": 0, "w1": 0}
    ratio = {"w0": 0.0, "w1": 0.0}
    since: dict[str, list[float]] = {"w0": [], "w1": []}   # probe times since its last step
    for kind, arg in script:
        if kind == "wait":
            now[0] += arg
        elif kind == "measured":                 # a step measured, the fit's ratio now
            worker, ratio[worker] = arg
            steps[worker] += 1
            since[worker] = []
        else:
            w = pb.WorkerStats(worker_id=arg, prefill_fit_steps=steps[arg],
                               prefill_fit_ratio=ratio[arg])
            probed = admission.probe(CFG, slots, w, HOPELESS, 1.0)
            if probed:
                since[arg].append(now[0])
            live = [t for t in since[arg] if now[0] - t < CFG.probe_hold_s]
            assert len(live) <= 1
            if steps[arg] and ratio[arg] <= CFG.probe_ratio:
                assert not probed                # a measured worker is never probed


@pytest.mark.parametrize("w", [
    pb.WorkerStats(worker_id="measured", prefill_fit_steps=1, prefill_fit_ratio=1.2),
    pb.WorkerStats(worker_id="busy", num_running=1),
    pb.WorkerStats(worker_id="queued", queued_prefill_tokens=200),
])
def test_a_measured_or_busy_worker_is_never_probed(w):
    assert not admission.probe(CFG, admission.Probes(10.0), w, HOPELESS, 1.0)


def test_a_best_case_within_the_target_or_far_past_it_is_no_probe():
    slots = admission.Probes(10.0)
    far = Prediction(wait_s=0.0, prefill_s=4.5, transfer_s=0.0, decode_wait_s=0.0)
    for p in (FINE, far):     # 0.3 s: admitted as usual; 4.5 s: past probe_slack x the target
        assert not admission.probe(CFG, slots, pb.WorkerStats(worker_id="w"), p, 1.0)
    assert slots.in_flight() == 0
    assert admission.probe(CFG, slots, pb.WorkerStats(worker_id="w"), HOPELESS, 1.0)


# ------------------------------------------------------------ what the worker publishes
def test_a_worker_publishes_how_much_slower_its_fit_prices_its_steps_than_they_ran():
    rates = WorkerRates(SMOLLM2, token_budget=512, chunk_size=256)
    assert rates.fields()["prefill_fit_ratio"] == 0.0          # nothing measured yet
    priced = rates.fit.step_time(200, attention_pairs(0, 200))  # 1.4 s: the prior's
    rates.on_step(200, 0, attention_pairs(0, 200), 0.35, 0.0)
    assert rates.fields()["prefill_fit_ratio"] == pytest.approx(priced / 0.35)


# ------------------------------------------------------------ the simulator decides alike
COLD_CHATS = """
name: cold-chats
description: 200-token chats at a steady pace on a cold fleet
seed: 1
duration_s: 5
scale: {rate: 1.0, prompt: 1.0, output: 1.0}
classes:
  interactive:
    slo: {ttft_s: 1.0, itl_s: 0.1}
    prompt_tokens: {dist: fixed, value: 200}
    output_tokens: {dist: fixed, value: 16}
tenants:
  chats: {class: interactive, weight: 1, arrival: {process: poisson, rate_rps: 5}}
"""


def simulated(tmp_path, policy: AdmissionConfig) -> list:
    """The router's decisions on a simulated co-located 70B replica whose workers publish the
    SmolLM2 CPU prior (1.4 s a chat) while their steps take tens of milliseconds."""
    path = tmp_path / "cold-chats.yaml"
    path.write_text(COLD_CHATS)
    spec = load_workload(str(path))
    sim_cfg = SimConfig(kv_tokens=400_000)
    gate = SimAdmissionConfig(policy=policy_for(spec, sim_cfg.network_gbps, policy))
    cfg = SimRunConfig(fleet=Fleet.parse("colocated:1"), sim=sim_cfg, admission=gate)
    timer, transfer_s = timing_of(cfg)
    sim = Simulation(spec, cfg, timer, transfer_s, kv_bytes_per_token_of(cfg, timer))
    for wid, r in list(sim.gate.rates.items()):
        sim.gate.rates[wid] = WorkerRates(SMOLLM2, token_budget=r.token_budget,
                                          chunk_size=r.chunk_size, clock=sim.clock,
                                          wall=sim.clock)
    sim.run()
    return sorted(sim.gate.decisions, key=lambda d: int(d.request_id.removeprefix("sim-")))


def test_a_simulated_cold_fleet_with_a_pessimistic_prior_serves_from_its_first_probe(tmp_path):
    before = simulated(tmp_path, AdmissionConfig(probe_slack=1.0))
    assert before and not any(d.admitted for d in before)
    assert {d.term for d in before} == {"prefill"}
    after = simulated(tmp_path, AdmissionConfig())
    assert after[0].admitted and after[0].probe
    # each probe went to an idle worker: the ones refused meanwhile were refused for "prefill"
    assert all(d.probe for d in after if d.admitted and d.best_case_s > d.target_s)
    assert all(d.term == "prefill" for d in after if not d.admitted)
