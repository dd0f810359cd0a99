"""`kvfleet bench burst`'s report (loadtests/burst.py): the prediction error is kvfleet's
predicted TTFT (each stream's last `timing`) against the TTFT the client measured, over the
served requests that carried one; a refusal or a server that predicts nothing (vLLM) adds none,
and `--per-request` lists every request with its refusal message."""
from __future__ import annotations

import asyncio

import pytest

from loadtests.burst import Outcome, report, sse_reads


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


def text(t: str) -> dict:
    return {"choices": [{"text": t}]}


def test_events_read_together_count_one_gap_not_zero_gaps_between_them():
    """Under load the gateway's events coalesce: three arrive in one read, 40 ms after the last.
    The client waited 40 ms once; the microseconds between parsing them are no inter-token gap."""
    o = Outcome("chat", 200, started=0.0)
    assert o.read([text("a")], 0.30)                                 # the first token: TTFT
    assert o.read([{"choices": [{"text": ""}]}], 0.31)               # no text: no gap
    assert o.read([text("b"), text("c"), text("d")], 0.35)
    assert o.read([text("e")], 0.37)
    assert o.ttft == pytest.approx(0.30) and o.tokens == 5
    assert o.itls == pytest.approx([0.05, 0.02])
    assert report([o], wall=1.0)["itl_p50_s"] > 0
    assert not o.read([text("f"), {"error": {"message": "a worker failed"}}], 0.4)
    assert o.code == "error_event"


def test_pieces_of_one_network_read_parsed_microseconds_apart_are_one_arrival():
    """httpx hands each HTTP chunk of one socket read over on its own: the gateway's events for
    three tokens, written as three chunks and read at once, reach the client 0.1 ms apart. The
    client waited once (40 ms), and the tokens still count."""
    o = Outcome("chat", 200, started=0.0)
    assert o.read([text("a")], 0.30)
    for t, at in (("b", 0.3400), ("c", 0.3401), ("d", 0.3402)):
        assert o.read([text(t)], at)
    assert o.read([text("e")], 0.3600)
    assert o.itls == pytest.approx([0.04, 0.0198]) and o.tokens == 5


def test_sse_events_are_grouped_by_the_read_that_brought_them_even_split_across_reads():
    async def chunks():
        for c in (b'data: {"n": 1}\n\ndata: {"n": 2}\n\nda', b'ta: {"n": 3}\n\n',
                  b"data: [DONE]\n\n"):
            yield c

    async def reads():
        return [[e["n"] for e in events] async for events in sse_reads(chunks())]
    assert asyncio.run(reads()) == [[1, 2], [3]]


def test_output_tokens_are_the_servers_usage_count_where_it_sent_one():
    """An event may carry two tokens: the usage event's count is what was generated; without
    one (a server that sends none), the events that brought text are counted."""
    o = Outcome("chat", 200, started=0.0)
    assert o.read([text("ab")], 0.1) and o.read([text("c")], 0.2)
    assert o.output_tokens == 2
    assert o.read([{"choices": [], "usage": {"completion_tokens": 3}}], 0.21)
    assert o.output_tokens == 3 and o.tokens == 2
    assert report([o], wall=1.0)["output_tokens_per_s"] == 3.0
