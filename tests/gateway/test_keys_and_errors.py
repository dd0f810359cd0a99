"""In-process pieces, no fleet: the API keys file is parsed strictly, keys authenticate to their
tenant, and router statuses become the right gateway errors."""
from __future__ import annotations

import grpc
import pytest
import yaml
from grpc.aio import AioRpcError, Metadata

from services.gateway.auth import KeyRing
from services.gateway.config import ANONYMOUS_KEY, exposure_refusal, load_api_keys
from services.gateway.errors import GatewayError, from_router
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


@pytest.mark.parametrize("code, details, trailing, status, error_code", [
    (grpc.StatusCode.INVALID_ARGUMENT, "exceeds_kv_capacity: needs 9 blocks", (), 400,
     "exceeds_kv_capacity"),
    (grpc.StatusCode.UNAVAILABLE, "no healthy mixed worker", (("retry-after", "2"),), 503,
     "unavailable"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "all busy", (("retry-after", "7"),), 429, "overloaded"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "all busy", (), 429, "overloaded"),
    (grpc.StatusCode.UNAVAILABLE, "Socket closed", (), 503, "unavailable"),
    (grpc.StatusCode.INTERNAL, "boom", (), 502, "upstream_error"),
])
def test_router_statuses_map_to_gateway_errors(code, details, trailing, status, error_code):
    """[H2]: every refusal, 429 (load) or 503 (no healthy capacity), carries Retry-After."""
    e = from_router(AioRpcError(code, Metadata(), Metadata(*trailing), details=details))
    assert (e.status, e.code) == (status, error_code)
    if status in (429, 503):
        hint = dict(trailing).get("retry-after", "1" if status == 429 else "2")
        assert e.headers() == {"Retry-After": hint}
    else:
        assert e.headers() == {}
    if status == 400:
        assert e.message == "needs 9 blocks"
