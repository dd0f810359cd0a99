"""The Gateway gRPC API: the REST semantics over kvfleet.v1, errors as gRPC status codes."""
from __future__ import annotations

import grpc
import pytest
import redis

from tests.waiting import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2_grpc as pb_grpc
from services.engine.sampling_params import SamplingParams
from tests.gateway.gateway_helpers import KEYS, slots_free, stream_counter

PROMPT = "Four score and seven years ago"


def auth(name: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {KEYS[name]['key']}"),)


@pytest.fixture
def stub(gateway):
    with grpc.insecure_channel(gateway.grpc) as channel:
        yield pb_grpc.GatewayStub(channel)


def generate(model: str, max_tokens: int, **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=model, text=PROMPT,
                              params=pb.SamplingParams(max_tokens=max_tokens, **params))


def test_generate_streams_the_engines_greedy_tokens(stub, gateway, engine):
    (ref,) = engine.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    call = stub.Generate(generate(gateway.model, 10, ignore_eos=True), metadata=auth("acme"))
    chunks = list(call)
    assert [t for c in chunks for t in c.token_ids] == ref.token_ids
    assert "".join(c.text for c in chunks) == ref.text
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert chunks[0].request_id.startswith("cmpl-")
    metadata = dict(call.initial_metadata())
    assert metadata["x-kvfleet-model"] == gateway.model and metadata["x-kvfleet-quality-version"]


def test_models_and_health(stub, gateway):
    (card,) = stub.ListModels(pb.ListModelsRequest(), metadata=auth("acme")).models
    assert (card.id, card.max_model_len) == (gateway.model, 4096) and card.quality_version
    assert stub.Health(pb.HealthRequest()).status == pb.HealthResponse.SERVING


@pytest.mark.parametrize("request_, metadata, code, words", [
    (pb.GenerateRequest(text=PROMPT, params=pb.SamplingParams(max_tokens=4)), (),
     grpc.StatusCode.UNAUTHENTICATED, "missing API key"),
    (pb.GenerateRequest(text=PROMPT, params=pb.SamplingParams(max_tokens=4)),
     (("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED, "incorrect API key"),
    (pb.GenerateRequest(model="gpt-4", text=PROMPT, params=pb.SamplingParams(max_tokens=4)),
     auth("acme"), grpc.StatusCode.NOT_FOUND, "gpt-4"),
    (pb.GenerateRequest(text=PROMPT, params=pb.SamplingParams(max_tokens=0)), auth("acme"),
     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7] * 2100), params=pb.SamplingParams(
        max_tokens=4)), auth("acme"), grpc.StatusCode.INVALID_ARGUMENT, "2048"),
    (pb.GenerateRequest(params=pb.SamplingParams(max_tokens=4)), auth("acme"),
     grpc.StatusCode.INVALID_ARGUMENT, "missing prompt"),
])
def test_errors_are_status_codes_with_the_rest_messages(stub, request_, metadata, code, words):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request_, metadata=metadata))
    assert info.value.code() == code and words in info.value.details()


def test_quota_refusal_is_resource_exhausted_with_retry_after(stub, gateway, fleet):
    slots_free(fleet.redis_url, "solo")              # "solo" may hold one stream at a time
    first = stub.Generate(generate(gateway.model, 2000, ignore_eos=True), metadata=auth("solo"))
    next(first)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(generate(gateway.model, 2), metadata=auth("solo")))
    first.cancel()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(info.value.trailing_metadata())["retry-after"]) >= 1
    assert wait_until(lambda: stream_counter(redis.Redis.from_url(fleet.redis_url), "solo") == 0, 1.0)


def test_cancel_by_request_id_ends_the_stream_and_frees_the_worker(stub, gateway, fleet):
    call = stub.Generate(pb.GenerateRequest(model=gateway.model, text=PROMPT, request_id="mine-1",
                                            params=pb.SamplingParams(max_tokens=2000, ignore_eos=True)),
                         metadata=auth("acme"))
    assert next(call).request_id == "mine-1"
    assert not stub.Cancel(pb.CancelRequest(request_id="mine-1"), metadata=auth("leaver")).cancelled
    assert stub.Cancel(pb.CancelRequest(request_id="mine-1"), metadata=auth("acme")).cancelled
    assert list(call)[-1].finish_reason == "abort"
    assert wait_until(lambda: fleet.stats("mixed-0").kv_blocks_reserved == 0, 1.0)


def test_cancelling_the_call_frees_the_worker(stub, gateway, fleet):
    call = stub.Generate(generate(gateway.model, 2000, ignore_eos=True), metadata=auth("acme"))
    next(call)
    call.cancel()
    assert wait_until(lambda: (lambda s: s.kv_blocks_used == 0 and s.kv_blocks_reserved == 0)(
        fleet.stats("mixed-0")), 1.0)
