"""A document's predicted TTFT counts the chats expected to arrive during its prefill: a worker
that publishes its prefill throughput by class (`prefill_tokens_per_wall_s_by_class`) has the
chats arriving at their measured rate queued beside the document in every step it is stepped
through, where the engine serves them first and leaves the document its class's share. A chat's
prediction does not change. Numbers are injected; the engine's Scheduler (real, over a real
BlockPool, no model) fed the same arrival stream, each step costing the same law, is the
truth."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from services.engine.config import BATCH, DOCUMENT, INTERACTIVE, Tenant
from services.engine.scheduler import attention_pairs
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.placements import PlacedPrompt, with_placed_prompts
from services.router.predict import Prediction, predict
from services.router.step_ahead import MAX_STEPS
from tests.engine.scheduler_helpers import add, make_scheduler, step

STEP_S, PER_TOKEN, PER_PAIR = 0.010, 2e-5, 1e-8
BUDGET, CHUNK = 256, 64
CLASSES = (INTERACTIVE, DOCUMENT, BATCH)
NOTHING_AHEAD = {c.name: 0 for c in CLASSES}


def at_rest(chats_per_s: float | None = None, documents_per_s: float = 0.0,
            chat_tokens: int = 0) -> pb.WorkerStats:
    """A prefill worker's beat with nothing running or queued, its fitted step cost published;
    its throughput by class when `chats_per_s` is given (else it does not say, as an older
    build), the total beside it; and its chats' prompts a second when `chat_tokens` (their mean
    length) is given."""
    w = pb.WorkerStats(worker_id="p0", role="prefill", prefill_step_s=STEP_S,
                       prefill_s_per_token=PER_TOKEN, prefill_s_per_pair=PER_PAIR,
                       token_budget=BUDGET, chunk_size=CHUNK, updated_at_unix_s=100.0,
                       queued_prefill_tokens_ahead=NOTHING_AHEAD,
                       prefill_step_tokens_ahead=NOTHING_AHEAD,
                       prefill_tokens_per_wall_s=(chats_per_s or 0.0) + documents_per_s)
    if chats_per_s is not None:
        w.prefill_tokens_per_wall_s_by_class.update(
            {"interactive": chats_per_s, "document": documents_per_s})
    if chat_tokens:
        w.prefill_prompts_per_wall_s_by_class.update({"interactive": chats_per_s / chat_tokens})
    return w


def predicted(beat: pb.WorkerStats, placed: list[tuple[str, str, int]], cls: str, tenant: str,
              tokens: int) -> Prediction:
    w = with_placed_prompts(beat, [PlacedPrompt(*p) for p in placed], CLASSES)
    return predict(w, tokens, traffic_class=cls, tenant=tenant, now_unix_s=100.2,
                   classes=CLASSES)


def queued_s(p: Prediction) -> float:
    """The predicted TTFT from the end of the step in flight (the engine's steps, stepped)."""
    return p.wait_s + p.prefill_s


def engine_seconds(queued: list[tuple[str, str, int]], chats_per_s: float,
                   chat_tokens: int = 0) -> float:
    """(class, tenant, tokens) queued at once on a prefill worker's engine; while the last one
    prefills, the chats arriving during each step (at `chats_per_s`, tenant c) join before the
    next one: chats of `chat_tokens` each, one as soon as that many tokens are due (0: the
    tokens due each step, in prompts of at most a chunk). When the last one's last token is
    computed, every step costing the law the worker fitted."""
    sched, _ = make_scheduler(num_blocks=16384, block_size=16, prefix_caching=False,
                              token_budget=BUDGET, chunk_size=CHUNK, max_running=BUDGET,
                              role="prefill", max_model_len=1 << 16,
                              tenants=(Tenant("a"), Tenant("b"), Tenant("c")))
    reqs = [add(sched, n, tenant=t, cls=c, max_tokens=1) for c, t, n in queued]
    last, t, due = reqs[-1], 0.0, 0.0
    while last.num_computed_tokens < last.num_prompt_tokens:
        out = step(sched)
        seconds = STEP_S + sum(PER_TOKEN * c.num_tokens
                               + PER_PAIR * attention_pairs(c.start_pos, c.num_tokens)
                               for c in out.prefills)
        t += seconds
        if chat_tokens:
            due += chats_per_s * seconds
            while due >= chat_tokens:
                add(sched, chat_tokens, tenant="c", max_tokens=1)
                due -= chat_tokens
            continue
        arriving = round(chats_per_s * seconds)
        while arriving > 0:
            add(sched, min(arriving, CHUNK), tenant="c", max_tokens=1)
            arriving -= CHUNK
    return t


@settings(max_examples=30, deadline=None)
@given(st.integers(200, 3000), st.sampled_from((0.0, 2_000.0, 6_000.0, 12_000.0)),
       st.sampled_from((0, 20, 64)))
def test_a_document_is_predicted_as_the_engine_runs_it_while_chats_arrive_at_the_measured_rate(
        tokens, chats_per_s, chat_tokens):
    """An idle prefill worker that measured chats prefilled at `chats_per_s` (and, when
    `chat_tokens`, their mean length); a document arrives and chats keep arriving at that rate,
    each going first in the step after it arrives (the document gets its class's share of the
    steps they wait in, the whole of the others). Its predicted time is the engine's, however
    many steps it takes (past the 64 a chat is stepped)."""
    truth = engine_seconds([("document", "a", tokens)], chats_per_s, chat_tokens)
    p = predicted(at_rest(chats_per_s, chat_tokens=chat_tokens), [], "document", "a", tokens)
    assert abs(queued_s(p) - truth) <= 1e-9 * truth


def test_chats_arriving_make_a_long_document_later_than_the_rule_that_queued_them_as_documents():
    """Before, the arrivals were queued as the document's own class (another tenant sharing its
    turns), so the document kept the whole budget they left; the engine serves the chats first
    and gives the document only its share while they wait: a document of 100 steps' prompt
    with 12K chat tokens a second is predicted at the engine's time, and later than an older
    worker's beat (no throughput by class) has it."""
    tokens, rate = 6400, 12_000.0
    truth = engine_seconds([("document", "a", tokens)], rate)
    by_class = queued_s(predicted(at_rest(rate), [], "document", "a", tokens))
    older = queued_s(predicted(at_rest(None, documents_per_s=rate), [], "document", "a", tokens))
    assert tokens // CHUNK > MAX_STEPS
    assert abs(by_class - truth) <= 1e-9 * truth
    assert older < 0.8 * truth


def test_with_no_arrivals_a_worker_that_says_them_by_class_is_predicted_as_one_that_does_not():
    """No throughput measured at all: the document's prediction is today's, whether the worker
    publishes the classes' throughput (all 0) or not."""
    placed = [("document", "a", 900), ("interactive", "b", 40), ("document", "b", 300)]
    for cls, tokens in (("document", 1500), ("interactive", 60)):
        assert (predicted(at_rest(0.0), placed, cls, "a", tokens)
                == predicted(at_rest(None), placed, cls, "a", tokens))


prompt = st.tuples(st.sampled_from(("interactive", "document")), st.sampled_from("ab"),
                   st.integers(1, 1500))


@settings(max_examples=40, deadline=None)
@given(st.lists(prompt, max_size=6), st.sampled_from("ab"), st.integers(1, 5000),
       st.floats(0.0, 20_000.0), st.floats(0.0, 20_000.0), st.sampled_from((0, 50, 400)))
def test_a_documents_prediction_never_falls_as_the_chats_arrival_rate_rises(
        placed, tenant, tokens, rate, more, chat_tokens):
    """More chats arriving a second (of the same mean length, when the worker says it) never
    makes a document's predicted TTFT earlier, whatever is queued on the worker."""
    low = predicted(at_rest(rate, chat_tokens=chat_tokens), placed, "document", tenant, tokens)
    high = predicted(at_rest(rate + more, chat_tokens=chat_tokens), placed, "document", tenant,
                     tokens)
    assert high.total_s >= low.total_s


@settings(max_examples=40, deadline=None)
@given(st.lists(prompt, max_size=6), st.sampled_from("ab"), st.integers(1, 500),
       st.floats(0.0, 20_000.0), st.floats(0.0, 20_000.0))
def test_a_chats_prediction_does_not_read_the_throughput_by_class(
        placed, tenant, tokens, chats, documents):
    """A chat is priced with the expected arrivals as before (all of them, as its own class):
    how the throughput splits by class does not move it."""
    split = at_rest(chats, documents)
    whole = at_rest(None, chats + documents)
    assert (predicted(split, placed, "interactive", tenant, tokens)
            == predicted(whole, placed, "interactive", tenant, tokens))
