"""What the engine publishes for the router's wait term: per class, the prompt tokens a new request
of it would wait behind in the scheduler's order (its own and higher class priorities)."""
from __future__ import annotations

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
