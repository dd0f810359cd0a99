"""A conversation's next turn goes where its prefix is: with two idle prefill workers (a real fleet:
Redis, router, workers as processes), the second turn of each conversation is placed on the worker
that served the first, because that worker's KV events told the router it holds the conversation so
far; the router's tie ring alone would alternate. The engine there finds the prefix in its cache."""
from __future__ import annotations

import urllib.request

import redis
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import wait_until
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.prefix_index import request_block_hashes
from services.state import kv_events
from services.state.records import MAC_BYTES, MAGIC
from tests.harness import route_request, running_fleet

SYSTEM = list(range(1000, 1100))                 # a shared system prompt: 100 tokens


def serving_two_prefill(fleet) -> bool:
    health = fleet.router_stub().Health(pb.HealthRequest())
    return health.status == pb.HealthResponse.SERVING and all(
        f"prefill-{i}" in health.detail for i in range(2))


def turn(fleet, rid: str, prompt: list[int]) -> tuple[str, list[int]]:
    """One turn: (the prefill worker that served it, the tokens it generated)."""
    chunks = list(fleet.generate(route_request(rid, prompt, 8, ignore_eos=True)))
    assert chunks[-1].finish_reason == "length"
    return chunks[0].served_by, [t for c in chunks for t in c.token_ids]


def prefix_hits(fleet, worker: str) -> float:
    """The worker's kvfleet_prefix_cache_hits counter, from its /metrics."""
    with urllib.request.urlopen(fleet.stats(worker).metrics_url, timeout=5) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "kvfleet_prefix_cache_hits" for s in f.samples
               if s.name.endswith("_total"))


class Stream:
    """The fleet's KV event stream, read as a test (the seal is not checked here)."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.after = "0-0"

    def batches(self):
        for _key, entries in self.client.xread({"kvfleet:kv-events": self.after}) or ():
            for entry_id, fields in entries:
                self.after = entry_id
                yield kv_events.decode(fields[b"b"][len(MAGIC) + MAC_BYTES:])

    def announced(self, worker: str, hashes: list[int]) -> bool:
        """Whether `worker` has published a batch holding `hashes` and one more batch after it
        (the router reads the stream in order: it has applied the first by then)."""
        seen = getattr(self, "_seen", None)
        for b in self.batches():
            if b.worker_id == worker and seen is not None and b.seq > seen:
                return True
            if b.worker_id == worker and set(hashes) <= set(b.stored):
                seen = self._seen = b.seq
        return False


def test_a_second_turn_goes_to_the_worker_that_served_the_first(redis_url, tiny_model_dir):
    with running_fleet(redis_url, str(tiny_model_dir), "disagg", prefill=2) as fleet:
        assert wait_until(lambda: serving_two_prefill(fleet), 60)
        # both workers prefill first (the tie ring alternates), so that by the conversations
        # one may publish a drain rate measured on these short prompts while the other still
        # publishes its prior's, tens of times faster: placement ranks by tokens, and the held
        # prefix wins all the same
        warm = {turn(fleet, f"warm-{i}", [4000 + i] * 40)[0] for i in range(6)}
        assert warm == {"prefill-0", "prefill-1"}, warm
        for conversation in range(3):
            first = SYSTEM + [2000 + conversation] * 20
            served_first, answer = turn(fleet, f"c{conversation}-t1", first)
            stream = Stream(fleet.redis_url)
            assert wait_until(lambda: stream.announced(
                served_first, request_block_hashes(first, "", 16)), 30)
            second = first + answer + [3000 + conversation] * 10
            served_second, _ = turn(fleet, f"c{conversation}-t2", second)
            assert served_second == served_first, conversation
        # each second turn found at least its first turn's full blocks (112 tokens: 7 blocks)
        assert sum(prefix_hits(fleet, f"prefill-{i}") for i in range(2)) >= 3 * 112
