"""The prediction-error breakdown (loadtests/prediction_terms.py) on a short simulated `mixed`
run: the actual terms it traces add up to each admitted request's TTFT, and with every term
exact the error is 0 (the KV transfer, which the first token does not wait for, is not a term
of the predicted TTFT)."""
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


def test_with_every_term_exact_nothing_is_left(rows):
    assert any(r.p_transfer_s > 0 for r in rows)          # predicted, but not part of the TTFT
    exact = pt.errors(rows, wait=True, in_flight=True, prefill=True, decode=True)
    assert exact == pytest.approx(np.zeros(len(rows)), abs=1e-9)
    assert "in flight" in pt.report(rows)
