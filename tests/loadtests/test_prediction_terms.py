"""The prediction-error breakdown (loadtests/prediction_terms.py) on a short simulated `mixed`
run: the actual terms it traces add up to each admitted request's TTFT, and with every term
exact the error is only the transfer term the first token does not wait for."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from loadtests import prediction_terms as pt


@pytest.fixture(scope="module")
def rows():
    args = argparse.Namespace(workload="mixed", fleet="disagg:1:1", rate_scale=10.0,
                              duration=3.0, seed=0)
    return pt.run(args)


def test_the_traced_terms_add_up_to_each_admitted_requests_ttft(rows):
    assert len(rows) > 50
    for r in rows:
        parts = r.router_wait_s + r.in_flight_s + r.queue_s + r.own_s
        assert parts == pytest.approx(r.ttft_s, abs=1e-9)
        assert min(r.router_wait_s, r.in_flight_s, r.queue_s, r.own_s) >= -1e-12


def test_with_every_term_exact_only_the_transfer_is_left(rows):
    exact = pt.errors(rows, wait=True, in_flight=True, prefill=True, decode=True)
    transfer = np.array([r.p_transfer_s / r.ttft_s for r in rows])
    assert exact == pytest.approx(transfer, abs=1e-9)
    assert "in flight" in pt.report(rows)
