"""In-process pieces, no fleet: the API keys file is parsed strictly, keys authenticate to their
tenant, and router statuses become the right gateway errors."""
from __future__ import annotations

import grpc
import pytest
import yaml
from grpc.aio import AioRpcError, Metadata

from services.gateway.auth import KeyRing
from services.gateway.config import ANONYMOUS_KEY, exposure_refusal, load_api_keys
from services.gateway.errors import GatewayError, from_status
from services.protocol import status
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.typed_stub import call_failed
from tests.gateway.gateway_helpers import key


def write(tmp_path, data) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_keys_file_is_strict(tmp_path):
    good = key("sk-1", "acme")
    assert load_api_keys(write(tmp_path, [good]))[0].tenant == "acme"
    for bad, words in [([], "non-empty"), ([{**good, "extra": 1}], "unknown ['extra']"),
                       ([{k: v for k, v in good.items() if k != "tenant"}], "missing ['tenant']"),
                       ([{**good, "requests_per_minute": 0}], "positive integer"),
                       ([{**good, "max_concurrent_streams": True}], "positive integer"),
                       ([good, good], "twice")]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            load_api_keys(write(tmp_path, bad))


def test_a_key_authenticates_to_its_tenant_and_never_shows_in_repr(tmp_path):
    keys = load_api_keys(write(tmp_path, [key("sk-secret-1", "acme")]))
    ring = KeyRing(keys)
    assert ring.authenticate("Bearer sk-secret-1").tenant == "acme"
    assert "sk-secret-1" not in repr(keys[0])
    for header in (None, "", "Bearer", "Basic sk-secret-1", "Bearer sk-secret-2"):
        with pytest.raises(GatewayError) as info:
            ring.authenticate(header)
        assert info.value.status == 401
    assert KeyRing(None).authenticate(None) is ANONYMOUS_KEY


def test_unauthenticated_serving_is_only_for_loopback():
    assert exposure_refusal("127.0.0.1", False, False) is None
    assert exposure_refusal("::1", False, False) is None
    assert exposure_refusal("0.0.0.0", True, False) is None          # keys authenticate
    assert exposure_refusal("0.0.0.0", False, True) is None          # --insecure, on purpose
    assert "refusing" in exposure_refusal("10.1.2.3", False, False)


def typed(reason, message: str, **fields) -> AioRpcError:
    """What a call that a service ended with `status.abort` raises at its caller's grpc."""
    st = status.failed(reason, message, **fields)
    return AioRpcError(status.GRPC_CODE.get(st.reason, grpc.StatusCode.UNKNOWN), Metadata(),
                       Metadata(*status.trailing(st)), details=st.message)


def bare(code: grpc.StatusCode, details: str) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(), details=details)


@pytest.mark.parametrize("error, http, error_code, retry_after", [
    (typed(pb.INVALID_REQUEST, "needs 9 blocks", code="exceeds_kv_capacity", param="max_tokens"),
     400, "exceeds_kv_capacity", None),
    (typed(pb.UNAVAILABLE, "no healthy mixed worker", retry_after_s=2), 503, "unavailable", "2"),
    (typed(pb.OVERLOADED, "all busy", retry_after_s=7), 429, "overloaded", "7"),
    (typed(pb.OVERLOADED, "all busy"), 429, "overloaded", "1"),
    (typed(pb.KV_TRANSFER_FAILED, "the KV did not arrive"), 503, "unavailable", "2"),
    (bare(grpc.StatusCode.RESOURCE_EXHAUSTED, "all busy"), 429, "overloaded", "1"),
    (bare(grpc.StatusCode.UNAVAILABLE, "Socket closed"), 503, "unavailable", "2"),
    (bare(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), 503, "unavailable", "2"),
    # a worker SIGKILLed mid-stream: grpc's core resets the stream INTERNAL, no CallStatus
    (bare(grpc.StatusCode.INTERNAL, "Internal error from Core"), 503, "unavailable", "2"),
    # a handler's uncaught exception, and a failure a worker reported itself without a reason
    (bare(grpc.StatusCode.UNKNOWN, "Unexpected <class 'RuntimeError'>: boom"), 502,
     "upstream_error", None),
    (typed(pb.REASON_UNSPECIFIED, "boom"), 502, "upstream_error", None),
])
def test_fleet_statuses_map_to_gateway_errors(error, http, error_code, retry_after):
    """Every refusal, 429 (load) or 503 (no healthy capacity), carries Retry-After; and the
    reason, the engine's code and field travel typed, no text is parsed. A call that broke
    without a CallStatus (UNAVAILABLE, a deadline, INTERNAL from grpc's core) is the fleet's
    availability; a worker's own failure keeps the reason it gave."""
    failed = call_failed(error)          # what the gateway's typed stub raises
    assert failed.untyped_code == (None if error.trailing_metadata() else error.code())
    e = from_status(failed.status)
    assert (e.status, e.code) == (http, error_code)
    # every fleet status names the overload stage it was decided in
    assert e.headers() == ({"Retry-After": retry_after} if retry_after else {}) | {
        "x-kvfleet-stage": "S0_NORMAL"}
    if http == 400:
        assert (e.message, e.param) == ("needs 9 blocks", "max_tokens")
