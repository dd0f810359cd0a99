"""The pieces of `kvfleet rebalance` that need no fleet: the orders' seal and schema, how an added
worker's arguments are made, the tail quantile from histogram buckets, the hand-set sizes."""
from __future__ import annotations

import json
import math

import pytest

from services.cli import fleet_orders as fo
from services.cli.rebalance_cmd import Snapshot, Targets, manual_sizes, p99, windows_of
from services.state.records import RecordSeal

SEAL = RecordSeal.from_token("a-fleet-token-of-enough-length")
OTHER = RecordSeal.from_token("another-fleet-token-entirely!!")


def test_an_order_round_trips_under_the_fleets_seal_and_no_other():
    order = fo.FleetOrder.new(fo.Action.DRAIN, "decode", "decode-3")
    assert fo.FleetOrder.decode(order.encode(SEAL), SEAL) == order
    with pytest.raises(fo.OrderError, match="refused"):
        fo.FleetOrder.decode(order.encode(OTHER), SEAL)


@pytest.mark.parametrize("body, problem", [
    ({"action": "explode", "role": "decode", "order_id": "x"}, "explode"),
    ({"action": "add", "role": "gateway", "order_id": "x"}, "role"),
    ({"action": "add", "role": "decode", "order_id": "../../etc"}, "order_id"),
    ({"action": "add", "role": "decode"}, "order_id"),
    (["add"], "JSON object"),
])
def test_a_malformed_order_is_an_error_never_an_action(body, problem):
    raw = SEAL.seal(fo.SEAL_KIND, "order", json.dumps(body).encode())
    with pytest.raises(fo.OrderError, match=problem):
        fo.FleetOrder.decode(raw, SEAL)


def test_an_added_worker_is_its_templates_copy_on_free_ports():
    template = ["services.cli.cli", "serve", "decode", "--worker-id", "decode-0", "--port", "7001",
                "--metrics-port", "7002", "--kv-port", "7003", "--redis-url", "redis://x"]
    assert fo.clone_args(template, "decode-0", "decode-4") == [
        "services.cli.cli", "serve", "decode", "--worker-id", "decode-4", "--redis-url",
        "redis://x"]
    assert fo.worker_index("decode-12", "decode") == 12
    assert fo.worker_index("fallback-decode-1", "decode") is None


def test_p99_of_what_a_histogram_gained_in_the_window():
    before = {0.1: 10.0, 0.2: 10.0, math.inf: 10.0}
    after = {0.1: 10.0, 0.2: 110.0, math.inf: 110.0}     # 100 new samples, all in (0.1, 0.2]
    assert p99(before, after) == pytest.approx(0.199)
    assert p99(after, after) is None
    assert p99({}, {0.5: 0.0, math.inf: 5.0}) == 0.5      # past the last finite bucket


def test_only_workers_present_through_the_window_count():
    a = Snapshot(0.0, {"prefill-0": ("prefill", 10.0, 0)}, {}, {})
    b = Snapshot(10.0, {"prefill-0": ("prefill", 15.0, 0), "prefill-1": ("prefill", 3.0, 0)},
                 {}, {})
    [(pool, w)] = windows_of(a, b, Targets({}, {})).items()
    assert pool == "prefill" and w.replicas == 1 and w.busy_s == 5.0


def test_each_class_is_held_to_its_own_target_and_the_worst_counts():
    targets = Targets({"interactive": 1.0, "document": 10.0, "batch": math.inf},
                      {"interactive": 0.1}, unit_ttft_s=1.0)
    after = {"interactive": {0.5: 100.0, math.inf: 100.0},        # p99 ~0.5 s: half its target
             "document": {8.0: 0.0, 16.0: 100.0, math.inf: 100.0},  # p99 ~16 s: 1.6x its target
             "batch": {100.0: 0.0, 1000.0: 10.0, math.inf: 10.0}}    # no target: not held
    assert targets.worst({}, after, targets.ttft, 1.0) == pytest.approx(1.59, abs=0.01)
    assert targets.worst(after, after, targets.ttft, 1.0) is None


def test_hand_set_sizes_are_checked():
    assert manual_sizes(["decode=2", "prefill=3"]) == {"decode": 2, "prefill": 3}
    for bad in ("decode", "router=2", "decode=0", "decode=x"):
        with pytest.raises(ValueError, match="POOL=N"):
            manual_sizes([bad])
