"""`kvfleet bench burst`'s report (loadtests/burst.py): the prediction error is kvfleet's
predicted TTFT (each stream's last `timing`) against the TTFT the client measured, over the
served requests that carried one; a refusal or a server that predicts nothing (vLLM) adds none,
and `--per-request` lists every request with its refusal message."""
from __future__ import annotations

import pytest

from loadtests.burst import Outcome, report


def test_the_prediction_error_is_over_the_served_requests_that_carried_a_prediction():
    outcomes = [Outcome("chat", 200, ttft=0.5, predicted_ttft=0.25, tokens=4),     # -50%
                Outcome("chat", 200, ttft=1.0, predicted_ttft=1.2, tokens=4),      # +20%
                Outcome("chat", 200, ttft=0.4, tokens=4),                          # vLLM: none
                Outcome("document", 429, code="overloaded",
                        message="overloaded: prefill: predicted TTFT 13 s vs target 10 s")]
    out = report(outcomes, wall=2.0, per_request=True)
    error = out["prediction_error"]
    assert error["n"] == 2
    assert error["p90"] == pytest.approx(0.5) and error["median_signed"] == pytest.approx(0.2)
    assert [r["predicted_ttft_s"] for r in out["requests"]] == [0.25, 1.2, None, None]
    assert out["requests"][3]["message"].startswith("overloaded: prefill: predicted TTFT 13 s")
    assert report(outcomes[2:3], wall=1.0)["prediction_error"] is None
    assert "requests" not in report(outcomes, wall=2.0)
