"""What the engine publishes for the router's wait term: per class, the prompt tokens a new request
of it would wait behind in the scheduler's order (its own and higher class priorities)."""
from __future__ import annotations

from services.engine.engine import PUBLISHED_PROMPTS, queued_computed, queued_prompts
from tests.engine.scheduler_helpers import add, make_scheduler, step


def test_a_chat_waits_behind_chats_only_a_document_behind_both():
    sched, _ = make_scheduler()
    add(sched, 40, cls="interactive")
    add(sched, 300, cls="document")
    add(sched, 100, cls="batch")
    assert sched.prefill_tokens_ahead() == {"interactive": 40, "document": 340, "batch": 440}
    assert sched.queued_prefill_tokens() == 440
    step(sched)                # a 64-token step, 32 a sequence: the chat's first, then the document's
    ahead = sched.prefill_tokens_ahead()
    assert ahead == {"interactive": 8, "document": 8 + 268, "batch": 440 - 64}


def test_each_tenants_queued_prompt_tokens_are_published_by_class():
    """The router's wait term follows the engine's DRR order over tenants from these."""
    sched, _ = make_scheduler()
    for _ in range(3):
        add(sched, 100, cls="interactive", tenant="a")      # a flood
    add(sched, 40, cls="interactive", tenant="b")
    add(sched, 300, cls="document", tenant="b")
    assert sorted(sched.prefill_queues()) == [("document", "b", 300), ("interactive", "a", 300),
                                              ("interactive", "b", 40)]
    step(sched)                # 64 tokens of chats, whichever tenant's DRR turn it was
    queues = {(c, t): n for c, t, n in sched.prefill_queues()}
    assert queues[("interactive", "a")] + queues.get(("interactive", "b"), 0) == 340 - 64
    assert queues[("document", "b")] == 300


def test_each_queued_prompt_is_listed_in_its_tenants_order_up_to_the_published_cap():
    """The router steps the scheduler forward from these (services/router/step_ahead.py); what is
    past the cap it still knows from the tenant's tokens."""
    sched, _ = make_scheduler(num_blocks=4096, max_running=64, token_budget=64)
    add(sched, 50, tenant="a")
    add(sched, 20, tenant="a")
    add(sched, 300, cls="document", tenant="b")
    assert queued_prompts(sched) == {("interactive", "a"): [50, 20], ("document", "b"): [300]}
    assert queued_computed(sched) == {("interactive", "a"): [0, 0], ("document", "b"): [0]}
    step(sched)                # 64 tokens: the chats' first chunks (32 each)
    assert queued_prompts(sched)[("interactive", "a")] == [18]
    assert queued_computed(sched)[("interactive", "a")] == [32]     # where its next chunk starts
    for _ in range(PUBLISHED_PROMPTS + 5):
        add(sched, 1, tenant="c")
    assert len(queued_prompts(sched)[("interactive", "c")]) == PUBLISHED_PROMPTS
