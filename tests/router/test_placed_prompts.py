"""The prompts a router placed on a prefill worker since its beat are queued there as the engine
queues them (at the back of their tenant's queue, by class), so each next prompt of a burst is
predicted behind them in the engine's own order: a document placed after others shares its steps
with theirs, a chat goes first and the documents' chunks only fill what the chats leave of a
step. Numbers are injected; the engine's Scheduler (real, over a real BlockPool, no model) with
the same cost law per step is the truth."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from services.engine.config import BATCH, DOCUMENT, INTERACTIVE, Tenant
from services.engine.scheduler import attention_pairs
from services.protocol.pb.kvfleet.v1 import kvfleet_pb2 as pb
from services.router.placements import PlacedPrompt, PlacedPrompts, with_placed_prompts
from services.router.predict import PATH_S, Prediction, predict
from services.router.step_ahead import stepped
from tests.engine.scheduler_helpers import add, make_scheduler, step

STEP_S, PER_TOKEN, PER_PAIR = 0.010, 2e-5, 1e-8
BUDGET, CHUNK = 256, 64
CLASSES = (INTERACTIVE, DOCUMENT, BATCH)
NOTHING_AHEAD = {c.name: 0 for c in CLASSES}


def at_rest(**fields) -> pb.WorkerStats:
    """A prefill worker's beat with nothing running or queued (so no step in flight), its fitted
    step cost published."""
    fields.setdefault("updated_at_unix_s", 100.0)
    return pb.WorkerStats(worker_id="p0", role="prefill", prefill_step_s=STEP_S,
                          prefill_s_per_token=PER_TOKEN,
                          prefill_s_per_pair=PER_PAIR, token_budget=BUDGET, chunk_size=CHUNK,
                          queued_prefill_tokens_ahead=NOTHING_AHEAD,
                          prefill_step_tokens_ahead=NOTHING_AHEAD, **fields)


def engine_seconds(prompts: list[tuple[str, str, int]]) -> list[float]:
    """(class, tenant, tokens) queued at once on a prefill worker's engine, in this order: when
    each one's last token is computed, every step costing the law the worker fitted."""
    sched, _ = make_scheduler(num_blocks=8192, block_size=16, prefix_caching=False,
                              token_budget=BUDGET, chunk_size=CHUNK, max_running=BUDGET,
                              role="prefill", max_model_len=8192,
                              tenants=(Tenant("a"), Tenant("b")))
    reqs = [add(sched, n, tenant=t, cls=c, max_tokens=1) for c, t, n in prompts]
    t, done = 0.0, {}
    while len(done) < len(reqs):
        out = step(sched)
        t += STEP_S + sum(PER_TOKEN * c.num_tokens
                          + PER_PAIR * attention_pairs(c.start_pos, c.num_tokens)
                          for c in out.prefills)
        done.update((i, t) for i, r in enumerate(reqs)
                    if i not in done and r.num_computed_tokens >= r.num_prompt_tokens)
    return [done[i] for i in range(len(reqs))]


def predicted(placed: list[tuple[str, str, int]], cls: str, tenant: str, tokens: int,
              beat: pb.WorkerStats | None = None) -> pb.Plan:
    w = with_placed_prompts(beat or at_rest(), [PlacedPrompt(*p) for p in placed], CLASSES)
    return predict(w, tokens, traffic_class=cls, tenant=tenant, now_unix_s=100.2,
                   classes=CLASSES)


def queued_s(p: Prediction) -> float:
    """The predicted TTFT from the end of the step in flight (the engine's steps, stepped)."""
    return p.wait_s + p.prefill_s


def own_steps(placed: list[tuple[str, str, int]], cls: str, tenant: str, tokens: int) -> list[int]:
    w = with_placed_prompts(at_rest(), [PlacedPrompt(*p) for p in placed], CLASSES)
    return [n for n, _, _ in stepped(w, tokens, 0, cls, tenant, {}, 0.0, 0.0, CLASSES)]


def test_a_placed_prompt_queues_behind_its_tenants_listed_prompts_and_their_unlisted_tail():
    """A worker lists its first prompts of a tenant and the rest as a sum: a prompt placed since
    is behind all of it, and its positions (computed) stay in step with the listed prompts."""
    beat = at_rest(queued_prefill_tokens=1000)
    beat.prefill_queues.add(traffic_class="document", tenant="a", tokens=1000, prompts=[300],
                            computed=[200])
    w = with_placed_prompts(beat, [PlacedPrompt("document", "a", 400, cached=32),
                                   PlacedPrompt("interactive", "b", 50)], CLASSES)
    docs, chats = w.prefill_queues
    assert (list(docs.prompts), list(docs.computed), docs.tokens) == (
        [300, 700, 400], [200, 0, 32], 1400)
    assert (chats.traffic_class, chats.tenant, list(chats.prompts), chats.tokens) == (
        "interactive", "b", [50], 50)
    assert w.queued_prefill_tokens == 1450
    assert dict(w.queued_prefill_tokens_ahead) == {"interactive": 50, "document": 450,
                                                  "batch": 450}


def test_four_documents_at_once_are_each_predicted_with_those_placed_before_them():
    """An idle worker; four documents arrive within one beat. The engine gives each document a
    chunk of every step while the budget lasts, so each later one shares its steps with those
    before it: the k-th is predicted at the engine's time for k side by side (before, every one
    was predicted as if alone)."""
    docs = [("document", "a", 2000)] * 4
    truth = engine_seconds(docs)
    ledger, beat, predictions = PlacedPrompts(), at_rest(), []
    for c, t, n in docs:
        w = ledger.onto(beat, CLASSES)
        predictions.append(queued_s(predict(w, n, traffic_class=c, tenant=t, now_unix_s=100.2,
                                            classes=CLASSES)))
        ledger.add(beat, PlacedPrompt(c, t, n))
    assert predictions[0] == engine_seconds(docs[:1])[0]      # the first: alone
    assert predictions[-1] == truth[-1]
    assert all(a < b for a, b in zip(predictions, predictions[1:]))
    ledger.take_back(beat, PlacedPrompt("document", "a", 2000))
    assert len(ledger.since_beat(beat)) == 3
    newer = at_rest(updated_at_unix_s=100.5)            # a newer beat lists them itself
    assert ledger.onto(newer, CLASSES) == newer


prompt = st.tuples(st.sampled_from(("interactive", "document")), st.sampled_from("ab"),
                   st.integers(1, 700))


@settings(max_examples=60, deadline=None)
@given(st.lists(prompt, max_size=8), prompt)
def test_each_prompt_of_a_burst_is_predicted_as_the_engine_runs_it_behind_those_placed_before(
        placed, mine):
    """Whatever chats and documents of whichever tenants were placed since an idle worker's beat,
    the next prompt's predicted TTFT is the engine's time to its last token behind them (no
    arrivals expected: the worker measured none), after the step in flight: the worker began one
    on the first of them as it arrived (a step of their first chunks; none when nothing is
    placed)."""
    truth = engine_seconds([*placed, mine])[-1]
    p = predicted(placed, *mine)
    assert abs(queued_s(p) - truth) <= 1e-9 * truth
    assert (p.in_flight_s > 0) == bool(placed)
    assert p.total_s == pytest.approx(PATH_S + p.in_flight_s + queued_s(p))


@settings(max_examples=60, deadline=None)
@given(st.lists(prompt, max_size=6), st.sampled_from("ab"), st.integers(1, 700),
       st.integers(0, 4), st.sampled_from((0.0, 5_000.0)))
def test_a_document_placed_ahead_never_lowers_a_later_documents_prediction(
        placed, tenant, tokens, where, arriving):
    """One more document placed before it (anywhere among those placed, of either tenant) never
    makes a document's predicted TTFT earlier, with or without arrivals expected meanwhile."""
    beat = at_rest(prefill_tokens_per_wall_s=arriving)
    more = [*placed]
    more.insert(min(where, len(more)), ("document", tenant, 500))
    assert (predicted(more, "document", tenant, tokens, beat).total_s
            >= predicted(placed, "document", tenant, tokens, beat).total_s)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, CHUNK), max_size=8), st.integers(1, CHUNK),
       st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 2000)), min_size=1, max_size=4))
def test_documents_never_take_a_chats_tokens_and_slow_it_only_in_the_steps_it_leaves_room(
        chats, tokens, documents):
    """The engine serves chats first and gives documents only what the chats leave of a step: a
    chat's tokens in each step are the same whatever documents are queued, its prediction never
    earlier; and when the chats fill every step up to its last, the documents do not move it
    (the step in flight aside: it holds whichever arrived first)."""
    ahead = [("interactive", "a", n) for n in chats]
    docs = [("document", t, n) for t, n in documents]
    alone = own_steps(ahead, "interactive", "a", tokens)
    assert own_steps(docs + ahead, "interactive", "a", tokens) == alone
    assert (predicted(docs + ahead, "interactive", "a", tokens).total_s
            >= predicted(ahead, "interactive", "a", tokens).total_s)
    fill = -(sum(chats) + tokens) % BUDGET       # chats ahead (a chunk each) that fill its steps
    full = ahead + [("interactive", "a", n) for n in [CHUNK] * (fill // CHUNK) + [fill % CHUNK]
                    if n]
    assert (queued_s(predicted(docs + full, "interactive", "a", tokens))
            == queued_s(predicted(full, "interactive", "a", tokens)))
