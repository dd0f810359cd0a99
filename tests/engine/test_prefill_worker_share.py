"""On a prefill worker a document's share while chats wait is of two chunks, not of the wide
token budget: a chat there holds a decode seat reserved on another worker until its KV lands, so
a step a document stretches to the whole budget keeps seats empty. With no chat waiting the
document takes the whole budget, and a co-located replica keeps its rule (its share is of the
budget)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from tests.engine.scheduler_helpers import add, make_scheduler

BUDGET, CHUNK = 2048, 512


def prefill_tokens(out, cls: str) -> int:
    return sum(c.num_tokens for c in out.prefills if c.request.traffic_class.name == cls)


def worker(role: str):
    sched, _ = make_scheduler(num_blocks=8192, role=role, token_budget=BUDGET, chunk_size=CHUNK,
                              max_running=64, reject_late=False)
    return sched


def documents(sched, n: int = 3) -> None:
    for _ in range(n):                          # each takes at most a chunk a step
        add(sched, 8000, cls="document", tenant="b")


def test_while_a_chat_waits_documents_take_their_share_of_two_chunks_on_a_prefill_worker():
    sched = worker("prefill")
    documents(sched)
    add(sched, 200, tenant="a")
    out = sched.schedule()
    assert prefill_tokens(out, "interactive") == 200
    assert prefill_tokens(out, "document") == CHUNK          # 0.5 x 2 chunks, not 0.5 x 2048


def test_with_no_chat_waiting_documents_take_the_whole_budget():
    sched = worker("prefill")
    documents(sched, 4)
    assert prefill_tokens(sched.schedule(), "document") == BUDGET


def test_a_colocated_replica_keeps_its_share_of_the_budget():
    sched = worker("mixed")
    documents(sched)
    add(sched, 200, tenant="a")
    assert prefill_tokens(sched.schedule(), "document") == BUDGET // 2


@settings(max_examples=50, deadline=None)
@given(chats=st.lists(st.integers(16, 600), min_size=1, max_size=6),
       docs=st.lists(st.integers(1000, 9000), min_size=1, max_size=3))
def test_a_prefill_workers_documents_never_pass_one_chunk_a_step_while_chats_wait(chats, docs):
    sched = worker("prefill")
    for n in docs:
        add(sched, n, cls="document", tenant="b")
    for n in chats:
        add(sched, n, tenant="a")
    out = sched.schedule()
    assert prefill_tokens(out, "document") <= CHUNK
    assert prefill_tokens(out, "interactive") == min(BUDGET, sum(min(n, CHUNK) for n in chats))
