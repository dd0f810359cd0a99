"""A decode worker told to stop (SIGTERM) while it streams a request stops quietly: it ends its
DecodeStream call itself (the request ends SHUTTING_DOWN at the gateway's side) before its gRPC
server stops, so there is no call left for the server to cancel, and its log holds no
traceback."""
from __future__ import annotations

import os
import signal

import pytest

from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from tests.harness import route_request, running_fleet


@pytest.fixture
def fleet(redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg") as fleet:
        assert fleet.serving(60.0)
        yield fleet


def test_sigterm_during_a_stream_ends_it_shutting_down_and_logs_no_traceback(fleet):
    call = fleet.generate(route_request("quiet-stop", list(range(3, 40)), 3000, ignore_eos=True))
    chunks = iter(call)
    for _ in range(3):                      # the decode worker streams tokens 2.. by now
        next(chunks)
    worker = fleet.launcher.children["decode-0"]
    os.kill(worker.proc.pid, signal.SIGTERM)    # the worker alone, as `kvfleet up` stops it
    with pytest.raises(status.CallFailed) as ended:
        for _ in chunks:
            pass
    assert ended.value.status.reason == pb.SHUTTING_DOWN, ended.value.status
    assert worker.proc.wait(timeout=60) == 0
    with open(fleet.launcher.log_path("decode-0")) as f:
        log = f.read()
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
