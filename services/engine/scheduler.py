"""The iteration scheduler: DESIGN.md section 5, the scheduling contract.

Each iteration, with token budget B:
  1. every running decode sequence gets its one token first;
  2. the rest of B goes to prefill chunks: classes by priority with aging, tenants within a class by
     weighted deficit round-robin, FCFS within a tenant, each chunk at most `chunk_size`;
  3. while interactive work waits, capped classes (documents, batch) get at most their share of B;
     while sequences decode, the iteration's prefill chunks attend over at most
     `max_prefill_attention` (query, key) pairs, so a chunk deep in a long prompt is shorter;
  4. admission reserves KV blocks for prompt + bounded output and respects per-tenant caps;
  5. EOS, stop, limit or cancel frees the pages in the same iteration (`finish`);
  6. a queued request predicted to miss its TTFT target by far (`reject_late_factor`) is rejected.
Decode protection (`protect_itl`): a sequence joins the batch (mixed role: at admission, before its
first chunk; decode role: once its KV has arrived) only while the step model's predicted step time
stays inside the ITL targets of the batch's classes (decode_protection.py); the rest wait in order.

Lifecycle (who changes what):
  add -> queue[class][tenant] (WAITING) -> _admit: pool.reserve, RUNNING -> chunks until the known
  tokens are computed -> sample -> decoding, one token per iteration -> finish: pool.free.
  Decode role: add_remote: pool.reserve, WAITING_FOR_KV -> kv_arrived: WAITING_FOR_SLOT ->
  _admit_decodes: RUNNING -> decoding as above.
  `schedule()` makes admission, allocation and preemption decisions and returns a plain plan;
  `update()` is the one place token counters move. The block pool owns block tables.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from services.engine.admission import (RateEstimator, blocks_to_reserve, cdiv, late_requests,
                                       sample_blocks, samples_to_fork, tenant_allows)
from services.engine.block_pool import BlockPool, hash_full_blocks, usable_prefix_blocks
from services.engine.config import SchedulerConfig
from services.engine.decode_protection import Seat, decode_admissions
from services.engine.errors import UnknownRequestError
from services.engine.fairness import (DeficitRoundRobin, capped_base, class_budget,
                                     effective_priority, priority_slot)
from services.engine.request import Request, Status
from services.engine.step_model import StepModel
from services.planner.step_time import BatchShape


class ReservationOverrun(RuntimeError):
    """A `reserve`-policy request needed KV past its reservation: a broken invariant, not input."""


@dataclass
class ScheduledChunk:
    """Compute `num_tokens` tokens of `request` from position `start_pos`."""

    request: Request
    start_pos: int
    num_tokens: int
    sample: bool                 # this chunk reaches the last known token: sample the next one
    num_prompt_logprob_rows: int  # leading rows whose logits give prompt logprobs (echo)

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids[self.start_pos:self.start_pos + self.num_tokens]

    @property
    def logit_rows(self) -> list[int]:
        rows = list(range(self.num_prompt_logprob_rows))
        if self.sample and (not rows or rows[-1] != self.num_tokens - 1):
            rows.append(self.num_tokens - 1)
        return rows


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    attention_left: float = math.inf   # (query, key) pairs prefill chunks may still attend over
    prefix_queries: int = 0   # tokens of the requests admitted this iteration looked up in ...
    prefix_hits: int = 0      # ... the prefix cache, and how many of them it held
    held_for_itl: set[str] = field(default_factory=set)  # ids of queued requests (tenant heads)
                              # refused admission for decode ITL
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks that
                              # update() forked (a sample's copy of a partial prompt block)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills)

    def prefill_of(self, req: Request) -> ScheduledChunk | None:
        return next((c for c in self.prefills if c.request is req), None)

    @property
    def shape(self) -> BatchShape:
        """The iteration's work as a step timer sees it (a decode attends over start_pos + 1)."""
        return BatchShape(prefill_chunks=tuple((c.num_tokens, c.start_pos) for c in self.prefills),
                          decode_contexts=tuple(c.start_pos + 1 for c in self.decodes))


MIN_CHUNK = 16   # tokens a prompt advances per iteration at least, whatever the attention cap


def attention_pairs(start: int, n: int) -> int:
    """(query, key) pairs of a chunk of n tokens from position start: query start + i sees
    start + i + 1 keys."""
    return n * start + n * (n + 1) // 2


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, *, max_model_len: int,
                 enable_prefix_caching: bool = True,
                 clock: Callable[[], float] = time.monotonic,
                 step_model: StepModel | None = None) -> None:
        self.config = config
        self.pool = pool
        self.block_size = pool.block_size
        self.max_model_len = max_model_len
        self.prefix_caching = enable_prefix_caching
        self.clock = clock
        self.requests: dict[str, Request] = {}          # every request holding or awaiting KV
        self.running: dict[str, Request] = {}           # admitted, in admission order (the batch)
        self.queues: dict[str, dict[str, deque[Request]]] = {c.name: {} for c in config.classes}
        self.holding: dict[str, set[str]] = {}          # tenant -> ids of its requests holding KV
        self.drr = {c.name: DeficitRoundRobin(config.drr_quantum) for c in config.classes}
        self.prefill_rate = RateEstimator()
        self.step_model = step_model or StepModel()     # predicts step time for decode protection
        self.slot_waiting: list[Request] = []           # decode role: KV here, waiting to join
        self.held_for_itl = 0                           # the latest schedule()'s held_for_itl
        self._admit_seq = itertools.count()
        self._admit_order: dict[str, int] = {}

    # ------------------------------------------------------------------ intake
    def add(self, req: Request) -> None:
        """Queue by vLLM's `priority` within the class and tenant (lower first, ties FCFS)."""
        self.requests[req.request_id] = req
        queue = self._queue(req)
        queue.insert(priority_slot(queue, req.params.priority, _waiting_priority), req)

    def add_remote(self, req: Request) -> list[int] | None:
        """Decode role: reserve prompt + bounded output for KV that a prefill worker will write.
        Returns the block ids to write the prompt's KV into, or None when this worker cannot
        back the reservation (it never over-commits)."""
        need = blocks_to_reserve(req, self.config, self.block_size, self.max_model_len)
        awaiting = sum(samples_to_fork(r, self.config) for r in self.requests.values()
                       if r.status == Status.WAITING_FOR_KV)
        awaiting += len(self.slot_waiting)
        if len(self.running) + awaiting + samples_to_fork(req, self.config) > self.config.max_running:
            return None
        if not self._tenant_allows(req, need) or not self.pool.reserve(req.request_id, need):
            return None
        self.requests[req.request_id] = req
        self._hold(req, Status.WAITING_FOR_KV)
        return self.pool.allocate(req.request_id, cdiv(req.num_prompt_tokens, self.block_size))

    def kv_arrived(self, request_id: str, first_token: int,
                   samples: Sequence[tuple[Request, int]] = ()) -> list[tuple[int, int]]:
        """Decode role: the prompt's KV is in the reserved blocks; start decoding, at once if the
        decode batch has room for it (decode protection), else in order as room frees up
        (WAITING_FOR_SLOT, keeping its reservation). `samples`: the request's other n - 1 samples
        with their first tokens (sampled by the prefill worker), forked here. Returns the KV
        block copies the forks need, (src, dst), for the caller."""
        req = self.requests.get(request_id)
        if req is None or req.status != Status.WAITING_FOR_KV:
            raise UnknownRequestError(f"{request_id} has no reservation awaiting KV")
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = Status.RUNNING
        self.running[request_id] = req
        copies = self._fork(req, first_token, samples)
        for r in (req, *(child for child, _ in samples)):
            if not r.is_finished:
                self.running.pop(r.request_id, None)
                r.status = Status.WAITING_FOR_SLOT
                self.slot_waiting.append(r)
        self._admit_decodes()
        return copies

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput(rejected=self._reject_late(now))
        self._admit_decodes()
        self._schedule_decodes(out)
        self._schedule_prefills(out, self.config.token_budget - len(out.decodes), now)
        self.held_for_itl = len(out.held_for_itl)
        return out

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine measured the step that ran `out`: the step model learns from it."""
        self.step_model.observe(out.shape, seconds)

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        """Step 1: every running decode sequence gets its token, before any prefill."""
        for req in self._decode_order():
            if req.status == Status.RUNNING and self._ensure_slots(req, req.num_tokens, out):
                out.decodes.append(ScheduledChunk(req, req.num_computed_tokens, 1, True, 0))

    def _schedule_prefills(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Steps 2-4: fill the rest of the budget with prefill chunks."""
        if out.decodes and self.config.max_prefill_attention:
            out.attention_left = self.config.max_prefill_attention
        interactive_waits = bool(self._tenants_with_work(self.config.interactive_class))
        for cls in self._class_order(now):
            if budget <= 0:
                return
            capped = interactive_waits and cls.name != self.config.interactive_class
            base = capped_base(self.config.role, self.config.token_budget, self.config.chunk_size)
            allowed = class_budget(cls, budget, base, capped)
            take = lambda tenant, n, c=cls.name: self._take(c, tenant, n, out)  # noqa: E731
            with self._attention_share(out, cls.share_while_interactive_waits if capped else 1.0):
                budget -= self.drr[cls.name].serve(self._tenants_with_work(cls.name), allowed,
                                                   take)

    @contextmanager
    def _attention_share(self, out: SchedulerOutput, share: float) -> Iterator[None]:
        """A capped class (documents while chats wait) may spend at most `share` of the
        iteration's attention pairs, as of its tokens: an aged document deep in its prompt would
        otherwise spend them all, leaving each chat behind it only the floor chunk."""
        whole = out.attention_left
        if share >= 1.0 or math.isinf(whole):
            yield
            return
        mine = min(whole, share * self.config.max_prefill_attention)
        out.attention_left = mine
        try:
            yield
        finally:
            out.attention_left = whole - (mine - out.attention_left)

    def _take(self, cls: str, tenant: str, max_tokens: int, out: SchedulerOutput) -> int:
        """Schedule up to max_tokens of one tenant's prefill work, FCFS. Returns tokens used.
        A request already given a chunk this iteration (an earlier DRR turn) has it extended, up
        to `chunk_size`: a lone tenant's turns are only `drr_quantum * weight` tokens each, and
        without this its prompt would prefill a quantum per iteration however large the budget."""
        used = 0
        for req in list(self.queues[cls].get(tenant, ())):
            if used >= max_tokens:
                break
            prev = out.prefill_of(req)
            have = prev.num_tokens if prev else 0
            floor = not have and not any(c.request.traffic_class.name == cls for c in out.prefills)
            if not have and self._attention_fit(req.num_computed_tokens, floor, out) < min(
                    req.num_uncomputed_tokens, MIN_CHUNK):
                break                      # the pairs are spent: it waits whole, in its order
            if req.status != Status.RUNNING and not self._admit(req, out):
                break                      # FCFS: the tenant's head waits for capacity or caps
            n = min(req.num_uncomputed_tokens - have, self.config.chunk_size - have, max_tokens - used)
            n = min(n, self._attention_fit(req.num_computed_tokens + have, floor, out))
            if n <= 0:
                continue
            if not self._ensure_slots(req, req.num_computed_tokens + have + n, out):
                break
            out.attention_left -= attention_pairs(req.num_computed_tokens + have, n)
            chunk = self._prefill_chunk(req, have + n)
            if prev is None:
                out.prefills.append(chunk)
            else:
                out.prefills[out.prefills.index(prev)] = chunk
            used += n
        return used

    @staticmethod
    def _attention_fit(start: int, floor: bool, out: SchedulerOutput) -> int:
        """The most tokens from position `start` whose attention fits what the iteration has left.
        With `floor` (the first chunk of its class this iteration) at least MIN_CHUNK tokens, so
        a long prompt always progresses however deep it is. Only one per class: were every
        queued prompt given the floor once the pairs ran out, a class's prompts would advance
        MIN_CHUNK tokens each, all together, and every one of them start late (processor
        sharing) instead of the first ones on time."""
        if math.isinf(out.attention_left):
            return 1 << 62
        # attention_pairs(start, n) = n * start + n * (n + 1) / 2 <= left, solved for n
        left = max(0.0, out.attention_left)
        b = start + 0.5
        n = int(math.sqrt(b * b + 2 * left) - b)
        return max(n, MIN_CHUNK if floor else 0)

    def _prefill_chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        rows = 0
        if req.params.prompt_logprobs is not None and req.num_preemptions == 0:
            rows = max(0, min(n, req.num_prompt_tokens - 1 - start))
        return ScheduledChunk(req, start, n, start + n == req.num_tokens, rows)

    # ----------------------------------------------------------- admission/KV
    def _admit(self, req: Request, out: SchedulerOutput) -> bool:
        """Reserve prompt + bounded output (minus prefix-cache hits). All or nothing. Only an
        admission counts its prefix lookup in `out` (a request refused for capacity looks up
        again next iteration)."""
        if len(self.running) + samples_to_fork(req, self.config) > self.config.max_running:
            return False
        if not self._decode_room([self._seat(req)]):
            out.held_for_itl.add(req.request_id)
            return False
        hits = self._prefix_hits(req)
        need = blocks_to_reserve(req, self.config, self.block_size, self.max_model_len)
        if not self._tenant_allows(req, need):
            return False
        if not self.pool.reserve(req.request_id, need - len(hits), shared=hits):
            return False
        req.num_computed_tokens = len(hits) * self.block_size
        req.num_registered_blocks = len(hits)
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens
        if self._looks_up_prefix(req):
            out.prefix_queries += req.num_tokens
            out.prefix_hits += req.num_computed_tokens
        self.running[req.request_id] = req
        self._hold(req, Status.RUNNING)
        return True

    def _prefix_hits(self, req: Request) -> list[int]:
        """Cached blocks of this tenant matching the request's leading full blocks. At least one
        token is always left to compute (its logits are needed)."""
        if not self._looks_up_prefix(req):
            return []
        usable = usable_prefix_blocks(req.num_tokens, self.block_size)
        hashes = self._block_hashes(req, usable)
        return self.pool.lookup_prefix(hashes)

    def _looks_up_prefix(self, req: Request) -> bool:
        return self.prefix_caching and req.params.prompt_logprobs is None

    def _ensure_slots(self, req: Request, upto_tokens: int, out: SchedulerOutput) -> bool:
        """Give `req` blocks for positions [0, upto_tokens). Under `reserve` the reservation
        always covers it; under `predict` it grows, preempting others, or preempts `req` itself
        (returns False)."""
        missing = cdiv(upto_tokens, self.block_size) - self.pool.held(req.request_id)
        if missing <= 0:
            return True
        short = missing - self.pool.reserved(req.request_id)
        if short > 0:
            if self.config.admission != "predict":
                # By construction never: max_tokens is clamped to the class output cap before a
                # request is made (engine.clamp_to_output_cap), and the reservation covers
                # prompt + min(max_tokens, cap). The engine loop fails the worker loudly if it is.
                raise ReservationOverrun(
                    f"{req.request_id} needs {short} blocks past its reservation under `reserve`")
            if not self._grow(req, short, out):
                return False
        self.pool.allocate(req.request_id, missing)
        return True

    def _grow(self, req: Request, blocks: int, out: SchedulerOutput) -> bool:
        while not self.pool.reserve(req.request_id, blocks):
            victim = self._victim()
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _victim(self) -> Request:
        """The lowest-priority, newest running sequence."""
        return min(self.running.values(),
                   key=lambda r: (r.traffic_class.priority, -self._admit_order[r.request_id]))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self._release(req)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        out.decodes = [c for c in out.decodes if c.request is not req]
        out.prefills = [c for c in out.prefills if c.request is not req]
        out.preempted.append(req)
        queue = self._queue(req)
        if req not in queue:
            queue.appendleft(req)

    # ------------------------------------------------------- decode protection
    def _admit_decodes(self) -> None:
        """Decode role: sequences whose KV arrived join the batch while it has room, in order
        (class priority, then arrival); the rest keep waiting with their reservations."""
        if not self.slot_waiting:
            return
        self.slot_waiting.sort(key=lambda r: (-r.traffic_class.priority, r.arrival_time))
        n = self._decode_room([self._seat(r) for r in self.slot_waiting])
        joining, self.slot_waiting = self.slot_waiting[:n], self.slot_waiting[n:]
        for req in joining:
            req.status = Status.RUNNING
            self.running[req.request_id] = req

    def _decode_room(self, candidates: list[Seat]) -> int:
        """How many of `candidates` may join the batch now (all when protection is off)."""
        if not self.config.protect_itl:
            return len(candidates)
        batch = [self._seat(r) for r in self.running.values()]
        return decode_admissions(self.step_model, batch, candidates, self.config.itl_headroom)

    def _seat(self, req: Request) -> Seat:
        return Seat(req.num_tokens, req.traffic_class.itl_target_s,
                    samples_to_fork(req, self.config))

    # ------------------------------------------------------------------ update
    def update(self, out: SchedulerOutput, sampled: Sequence[int],
               forks: Mapping[str, Sequence[tuple[Request, int]]] | None = None) -> list[Request]:
        """Apply one iteration: advance computed tokens, append sampled tokens (one per chunk
        with `sample`, in `out.chunks` order), finish on EOS / stop token / length. `forks`: for
        a request sampling its first token with n > 1, its other samples and their first tokens
        (drawn from the same logits): they fork here (`_fork`; KV copies in out.block_copies).
        Returns the requests that received a token, in order (a request before its samples)."""
        tokens = iter(sampled)
        advanced: list[Request] = []
        for chunk in out.chunks:
            req = chunk.request
            req.num_computed_tokens += chunk.num_tokens
            self._cache_computed_blocks(req)
            if chunk.sample:
                samples = (forks or {}).get(req.request_id, ())
                out.block_copies += self._fork(req, next(tokens), samples)
                advanced.append(req)
                advanced.extend(child for child, _ in samples)
        return advanced

    # -------------------------------------------------------------------- fork
    def _fork(self, req: Request, token: int,
              samples: Sequence[tuple[Request, int]]) -> list[tuple[int, int]]:
        """Append `token` to `req` and start its other samples with theirs (n > 1, at the first
        token). Each sample shares the prompt's full blocks (ref-counted) and gets a copy of a
        partial last prompt block, from its request's reservation (blocks_for_samples). A
        prefill worker forks nothing: the request and its samples are PREFILLED, their first
        tokens travel with the KV, and the decode worker forks. Returns the (src, dst) copies."""
        if not samples:
            self._append_token(req, token)
            return []
        if self.config.role == "prefill":
            req.token_ids.append(token)
            req.first_token_time = self.clock()
            for child, first in samples:      # outside the pool: they hold no KV here
                child.token_ids.append(first)
                child.first_token_time, child.status = req.first_token_time, Status.PREFILLED
            self.finish(req, Status.PREFILLED)
            return []
        per_sample = sample_blocks(req, self.config, self.block_size, self.max_model_len)
        copies = [copy for child, _ in samples
                  if (copy := self._start_sample(req, child, per_sample)) is not None]
        self._append_token(req, token)
        for child, first in samples:
            self._append_token(child, first)
        return copies

    def _start_sample(self, req: Request, child: Request, reserve: int) -> tuple[int, int] | None:
        """`child` runs from here as a request of its own whose blocks begin as `req`'s."""
        child.num_computed_tokens = req.num_computed_tokens
        child.block_hashes = list(req.block_hashes)
        child.num_registered_blocks = min(req.num_registered_blocks,
                                          req.num_computed_tokens // self.block_size)
        copy = self.pool.fork(req.request_id, child.request_id, req.num_computed_tokens, reserve)
        self.requests[child.request_id] = child
        self.running[child.request_id] = child
        self._hold(child, Status.RUNNING)
        return copy

    def _append_token(self, req: Request, token: int) -> None:
        req.token_ids.append(token)
        if req.num_output_tokens == 1 and req.first_token_time is None:
            req.first_token_time = self.clock()
        queue = self.queues[req.traffic_class.name].get(req.tenant)
        if queue and req in queue:
            queue.remove(req)
        status = self._finish_status(req, token)
        if status is not None:
            self.finish(req, status, stop_reason=token if status == Status.FINISHED_STOPPED else None)

    def _finish_status(self, req: Request, token: int) -> Status | None:
        p = req.params
        stop_token = (token in req.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if stop_token and req.num_output_tokens > p.min_tokens:   # barred up to min_tokens
            return Status.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return Status.FINISHED_LENGTH
        if self.config.role == "prefill":
            return Status.PREFILLED
        return None

    def finish(self, req: Request, status: Status, stop_reason: str | int | None = None) -> None:
        """End a request now. Its pages go back to the pool in this same iteration, except a
        prefill-role request's, which stay until `release()` after export."""
        if req.is_finished:
            return
        queue = self.queues[req.traffic_class.name].get(req.tenant)
        if queue and req in queue:
            queue.remove(req)
        if req.status == Status.WAITING_FOR_SLOT:
            self.slot_waiting.remove(req)
        req.status = status
        req.stop_reason = stop_reason
        self.running.pop(req.request_id, None)
        if status != Status.PREFILLED:
            self._release(req)
            self.requests.pop(req.request_id, None)

    def cancel(self, request_id: str) -> Request | None:
        """Cancel wherever the request is: queued, prefilling, decoding, awaiting KV or held
        for export. Frees everything it holds now. Unknown or finished ids: None."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status == Status.PREFILLED:
            self.release(request_id)
            return req
        self.finish(req, Status.FINISHED_ABORTED)
        return req

    def release(self, request_id: str) -> None:
        """Prefill role: the KV was exported; free the pages."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self._release(req)

    # ----------------------------------------------------------------- helpers
    def _hold(self, req: Request, status: Status) -> None:
        req.status = status
        self._admit_order[req.request_id] = next(self._admit_seq)
        self.holding.setdefault(req.tenant, set()).add(req.request_id)

    def _release(self, req: Request) -> None:
        self.pool.free(req.request_id)
        self.running.pop(req.request_id, None)
        self._admit_order.pop(req.request_id, None)
        self.holding.get(req.tenant, set()).discard(req.request_id)

    def _tenant_allows(self, req: Request, new_blocks: int) -> bool:
        tenant = self.config.tenant(req.tenant)
        assert tenant is not None, f"unknown tenant {req.tenant!r} passed validation"
        ids = self.holding.get(req.tenant, ())
        committed = sum(self.pool.held(i) + self.pool.reserved(i) for i in ids)
        return tenant_allows(tenant, len(ids), committed, new_blocks)

    def _block_hashes(self, req: Request, n: int) -> list[int]:
        """The first n links of the request's hash chain (salted by tenant), extended lazily."""
        if len(req.block_hashes) < n:
            start = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else None
            bs = self.block_size
            req.block_hashes.extend(hash_full_blocks(req.token_ids[start * bs:n * bs], bs,
                                                     req.tenant, parent_hash=parent))
        return req.block_hashes[:n]

    def _cache_computed_blocks(self, req: Request) -> None:
        """Register blocks that just became full and computed in the prefix cache."""
        if not self.prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_registered_blocks:
            return
        hashes = self._block_hashes(req, full)
        table = self.pool.block_table(req.request_id)
        for i in range(req.num_registered_blocks, full):
            self.pool.cache_block(table[i], hashes[i])
        req.num_registered_blocks = full

    def _queue(self, req: Request) -> deque[Request]:
        return self.queues[req.traffic_class.name].setdefault(req.tenant, deque())

    def _tenants_with_work(self, cls: str) -> dict[str, float]:
        return {t: self.config.tenant(t).weight for t, q in self.queues[cls].items() if q}

    def _class_order(self, now: float) -> list:
        """Classes with queued prefill work, by effective priority of their oldest request
        (anywhere in a queue: `priority` may put a newer request at its head)."""
        ranked = []
        for cls in self.config.classes:
            oldest = [min(r.arrival_time for r in q) for q in self.queues[cls.name].values() if q]
            if oldest:
                ranked.append((-effective_priority(cls, now - min(oldest)), cls.priority, cls))
        return [c for *_, c in sorted(ranked, key=lambda x: (x[0], -x[1]))]

    def _decode_order(self) -> Iterator[Request]:
        decoding = [r for r in self.running.values() if r.is_decoding]
        if self.config.admission == "predict":   # victims (lowest, newest) come last
            decoding.sort(key=lambda r: (-r.traffic_class.priority,
                                         self._admit_order[r.request_id]))
        return iter(decoding)

    def _reject_late(self, now: float) -> list[Request]:
        """Step 6: reject queued requests predicted to start past their class TTFT target."""
        if not self.config.reject_late or not self.prefill_rate.ready:
            return []
        queued = [r for qs in self.queues.values() for q in qs.values() for r in q]
        waiting = [r for r in queued if r.status != Status.RUNNING]
        if not waiting:
            return []
        in_progress = [r for r in queued if r.status == Status.RUNNING]
        late = late_requests(waiting, in_progress, self.prefill_rate.optimistic, now,
                             {t.name: t.weight for t in self.config.tenants},
                             self.config.reject_late_factor, self.config.interactive_class)
        for item in late:
            item.request.reject_reason = item.reason
            item.request.retry_after_s = item.retry_after_s
            self.finish(item.request, Status.FINISHED_REJECTED)
        return [item.request for item in late]

    # ------------------------------------------------------------------- stats
    @property
    def has_work(self) -> bool:
        return bool(self.running or self.slot_waiting) or any(
            q for qs in self.queues.values() for q in qs.values())

    @property
    def num_waiting_for_decode_slot(self) -> int:
        """Sequences decode protection holds back: decode role, those whose KV arrived and wait
        to join the batch; mixed role, the queued requests the latest schedule() refused to admit
        for ITL (each tenant's first; those behind it wait for it in FCFS)."""
        return len(self.slot_waiting) + self.held_for_itl

    def prefill_unstarved(self, out: SchedulerOutput) -> bool:
        """Whether `out` (just scheduled, not yet run) prefilled every queued prompt to its chunk
        cap: each got a whole `chunk_size`. Such a step was neither cut short by the token budget
        nor left idle for want of work (a prompt shorter than a chunk leaves room: its step's
        tokens over its time would read as a slow engine), so its prefill tokens over its time
        are the engine's rate (a lone document's 512-token chunks included). False when nothing
        was prefilled."""
        if not out.prefills:
            return False
        given = {id(c.request): c.num_tokens for c in out.prefills}
        for qs in self.queues.values():
            for q in qs.values():
                for r in q:
                    if r.num_uncomputed_tokens > 0 and given.get(id(r), 0) < self.config.chunk_size:
                        return False
        return True

    def queued_prefill_tokens(self) -> int:
        return sum(r.num_uncomputed_tokens for qs in self.queues.values() for q in qs.values()
                   for r in q)

    def prefill_tokens_ahead(self) -> dict[str, int]:
        """Per class, the prompt tokens not yet computed that a new request of it would wait
        behind: those of its own and higher class priorities (prefill goes by class priority)."""
        by_priority: dict[int, int] = {}
        for c in self.config.classes:
            tokens = sum(r.num_uncomputed_tokens for q in self.queues[c.name].values() for r in q)
            by_priority[c.priority] = by_priority.get(c.priority, 0) + tokens
        return {c.name: sum(n for p, n in by_priority.items() if p >= c.priority)
                for c in self.config.classes}

    def prefill_queues(self) -> list[tuple[str, str, int]]:
        """(class, tenant, prompt tokens not yet computed) of each tenant with prefill work."""
        out = []
        for cls, qs in self.queues.items():
            for tenant, q in qs.items():
                tokens = sum(r.num_uncomputed_tokens for r in q)
                if tokens:
                    out.append((cls, tenant, tokens))
        return out

    def prefill_step_tokens_ahead(self) -> dict[str, int]:
        """Per class, what the prompts a new request of it waits behind take of one step: each
        at most its chunk (`chunk_size`), so a lone long prompt leaves the rest of the budget to
        those behind it."""
        by_priority: dict[int, int] = {}
        for c in self.config.classes:
            tokens = sum(min(self.config.chunk_size, r.num_uncomputed_tokens)
                         for q in self.queues[c.name].values() for r in q)
            by_priority[c.priority] = by_priority.get(c.priority, 0) + tokens
        return {c.name: sum(n for p, n in by_priority.items() if p >= c.priority)
                for c in self.config.classes}

    def num_queued(self) -> int:
        return sum(1 for qs in self.queues.values() for q in qs.values() for r in q
                   if r.status != Status.RUNNING)

    def oldest_queued_arrival(self) -> float | None:
        """Arrival time of the longest-waiting request not yet admitted (queued or preempted)."""
        return min((r.arrival_time for qs in self.queues.values() for q in qs.values() for r in q
                    if r.status != Status.RUNNING), default=None)

    def tenant_shares(self) -> list[tuple[str, int, int]]:
        """(tenant, sequences holding KV, KV blocks held or reserved) per tenant holding any,
        largest KV first. Sequences awaiting KV (decode role) and prefilled ones awaiting export
        count: their blocks are taken. A prefix block shared by several counts for each."""
        shares = []
        for tenant, ids in self.holding.items():
            if ids:
                blocks = sum(self.pool.held(i) + self.pool.reserved(i) for i in ids)
                shares.append((tenant, len(ids), blocks))
        shares.sort(key=lambda s: (-s[2], -s[1], s[0]))
        return shares


def _waiting_priority(req: Request) -> int | None:
    """A queued request's rank for priority_slot; None for an admitted one (keeps its place)."""
    return None if req.status == Status.RUNNING else req.params.priority
