"""LLMEngine: the in-process API (add request, step, stream outputs, cancel, stats).

One `step()` is one model iteration:
  1. scheduler.schedule()  -> plan: decode tokens first, then prefill chunks (KV reserved)
  2. executor.execute     -> one token per sequence that reached its last known token, and
                              prompt logprobs (executor.py: the model and the sampler, or the
                              simulated core's deterministic tokens, config.sim)
  3. scheduler.update()    -> counters advance, EOS / length finish and free pages
  4. output states         -> text deltas, stop strings (finish + free in this same step);
                              none with config.detokenize off (the fleet: the gateway's text;
                              its outputs are TokenOutputs, no text field)
The engine is single-threaded: callers (a worker's event loop, the CLI) drive `step()`.
"""
from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from services.engine.admission import RateEstimator
from services.engine.block_pool import BlockPool
from services.engine.config import EngineConfig, SchedulerConfig
from services.engine.errors import DuplicateRequestError, UnknownRequestError
from services.engine.model.config import ModelConfig
from services.engine.outputs import CompletionOutput, OutputState, TokenOutput
from services.engine.request import Request, Status
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerOutput, attention_pairs
from services.engine.step_model import StepModel
from services.engine.tokenizer import Tokenizer
from services.engine.validation import RequestValidator


@dataclass(frozen=True)
class EngineStats:
    num_queued: int
    num_running: int
    num_decoding: int
    num_waiting_for_kv: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    kv_blocks_reserved: int
    kv_blocks_cached: int
    steps: int
    prefill_tokens: int
    decode_tokens: int
    preemptions: int
    rejections: int
    queued_prefill_tokens: int   # prompt tokens not yet computed, queued or mid-prefill
    prefill_tokens_per_s: float  # measured (EMA), 0 until known
    decode_tokens_per_s: float
    last_step_s: float
    last_schedule_s: float       # schedule() alone
    last_prepare_s: float        # building the chunks, the flat batch and attention metadata
    oldest_queued_s: float = 0.0  # age of the longest-waiting request not yet admitted; 0 if none
    num_waiting_for_decode_slot: int = 0  # held back by decode protection (ITL), reservations kept
    # (tenant, sequences holding KV, KV blocks held or reserved), largest KV first
    tenants: list[tuple[str, int, int]] = field(default_factory=list)
    # per class, the prompt tokens a new request of it waits behind (Scheduler.prefill_tokens_ahead)
    prefill_tokens_ahead: dict[str, int] = field(default_factory=dict)
    # (class, tenant, prompt tokens not yet computed) of each tenant with prefill work queued
    prefill_queues: list[tuple[str, str, int]] = field(default_factory=list)
    decode_context_tokens: int = 0   # tokens the decoding sequences attend over, summed
    max_running: int = 0             # the scheduler's cap on admitted sequences
    max_prefill_attention: int = 0   # its cap on a decoding step's prefill pairs (0: none)
    # per class, what the prompts ahead take of one step (Scheduler.prefill_step_tokens_ahead)
    prefill_step_tokens_ahead: dict[str, int] = field(default_factory=dict)
    # (class, tenant) -> each queued prompt's tokens not yet computed, in queue order (the first
    # PUBLISHED_PROMPTS of each tenant)
    prefill_prompts: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    # ... and each of those prompts' tokens already computed, in the same order
    prefill_computed: dict[tuple[str, str], list[int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step() that ran the model did (`LLMEngine.last_step`); times on the engine's
    clock."""

    prefill_tokens: int
    decode_tokens: int            # one per decoding sequence
    num_prefill_seqs: int
    num_decode_seqs: int
    duration_s: float             # the step, schedule to outputs
    gap_s: float                  # before it, while work waited (from when work arrived if idle)
    kv_read_bytes: int            # KV the decode sequences attended over: context x bytes/token
    prefix_queries: int           # tokens of requests admitted this step looked up in the prefix
    prefix_hits: int              # cache, and the tokens it held
    preemptions: int
    prefill_chunks: list[tuple[str, int]]   # (request id, tokens) per prefill chunk
    attention_pairs: int = 0      # (query, key) pairs: prefill chunks' and decodes' (contexts)
    # the prefill tokens by their prompts' traffic class, and the prompts they were (each chunk
    # as its share of its prompt): what the worker's arrival rates by class count (rates.py)
    prefill_by_class: dict[str, int] = field(default_factory=dict)
    prompts_by_class: dict[str, float] = field(default_factory=dict)


def _by_class(prefills) -> dict[str, dict]:
    """A step's prefill chunks summed by their prompts' class: tokens, and prompts (each chunk as
    the part of its prompt it prefilled), StepRecord's prefill_by_class / prompts_by_class."""
    tokens: dict[str, int] = {}
    prompts: dict[str, float] = {}
    for c in prefills:
        name = c.request.traffic_class.name
        tokens[name] = tokens.get(name, 0) + c.num_tokens
        prompts[name] = prompts.get(name, 0.0) + c.num_tokens / max(1, c.request.num_prompt_tokens)
    return {"prefill_by_class": tokens, "prompts_by_class": prompts}


def resolve_model_dir(model: str) -> str:
    """`tiny`, a named model (model_zoo.py: made into the cache on first use), or a directory."""
    from services.engine.model_zoo import resolve  # noqa: PLC0415
    return resolve(model)


# Allocates the KV cache's memory: (shape, dtype) -> zeroed memory (e.g. shared): a torch tensor
# for the model's cache, a numpy array for the simulated core's (which imports no torch).
KVAllocator = Callable[[tuple[int, ...], object], object]


class LLMEngine:
    def __init__(self, config: EngineConfig, clock=time.monotonic,
                 kv_alloc: KVAllocator | None = None, step_timer=None) -> None:
        """`config.sim` set: the simulated core (sim_engine.py), whose steps last what
        `step_timer` (a StepTimer; default: the one config.sim names) says; see
        `last_step_modelled_s`. The engine never sleeps: its caller paces."""
        self.config = config
        model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir) if has_tokenizer(model_dir) else None
        # where tokens come from (services/engine/executor.py): the model, or the simulated core
        self.executor = _make_executor(config, model_dir, self.model_config, self.tokenizer,
                                       kv_alloc, step_timer)
        self.kv_cache = self.executor.kv_cache
        self.kv_bytes_per_token = self.executor.kv_bytes_per_token  # all layers, K+V (a rank's)
        self.tp_leader = self.executor.tp_leader  # rank 0 of config.tensor_parallel_size, if > 1
        num_blocks = self.executor.num_blocks
        self.pool = BlockPool(num_blocks, config.block_size)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        timer = getattr(self.executor, "timer", None)   # a simulated core's: the step model's prior
        self.scheduler = Scheduler(config.scheduler, self.pool, max_model_len=self.max_model_len,
                                   enable_prefix_caching=config.enable_prefix_caching, clock=clock,
                                   step_model=StepModel.from_timer(timer) if timer else None)
        self.validator = RequestValidator(config.scheduler, self.model_config, self.tokenizer,
                                          self.pool, self.max_model_len)
        self.executor.bind(self.pool.block_table)
        self.clock = clock
        self._states: dict[str, OutputState] = {}
        # what turns output tokens into text: None when this engine makes no text
        self._text_tokenizer = self.tokenizer if config.detokenize else None
        self._generators: dict[str, object | None] = {}   # the executor's (torch.Generator)
        # n > 1: a request's forked samples (internal ids), and per request id how many of its
        # samples have not sent their last output (the output that brings it to 0 is `finished`)
        self._samples: dict[str, list[str]] = {}
        self._left: dict[str, int] = {}
        self._doomed: dict[str, set[str]] = {}    # samples cancelled before their fork
        self._pending: list[TokenOutput] = []   # outputs of requests ended between steps
        self._ids = itertools.count()
        self._counters = dict(steps=0, prefill_tokens=0, decode_tokens=0, preemptions=0,
                              rejections=0)
        self._last = (0.0, 0.0, 0.0)
        self._decode_rate = RateEstimator()
        self.last_step: StepRecord | None = None   # the latest step(), if it ran the model
        # simulated core: the target's time for the latest step (0 when it ran nothing, and
        # always for the real engine); the caller sleeps to it or advances a virtual clock by it
        self.last_step_modelled_s = 0.0
        self._ready_since: float | None = None     # since when work waits for a step; None: idle

    # --------------------------------------------------------------------- API
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    tenant: str | None = None, traffic_class: str | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request. Raises an InvalidRequestError subclass (with a code and
        a message naming the limits) for bad input; nothing else is affected."""
        req = self._make_request(prompt, params, tenant, traffic_class, request_id)
        self.scheduler.add(req)
        if self._ready_since is None:
            self._ready_since = req.arrival_time
        return req.request_id

    def step(self) -> list[TokenOutput]:
        t0 = time.perf_counter()
        start = self.clock()
        gap = start - self._ready_since if self._ready_since is not None else 0.0
        plan = self.scheduler.schedule()
        unstarved = self.scheduler.prefill_unstarved(plan)   # before the step moves the prompts
        t1 = time.perf_counter()
        outputs, self._pending = self._pending, []
        outputs += [self._delta(r) for r in plan.rejected]
        ran = bool(plan.decodes or plan.prefills)
        if ran:
            for c in plan.prefills:
                if c.request.first_scheduled_time is None:
                    c.request.first_scheduled_time = start
            outputs += self._execute(plan)
        measured = time.perf_counter() - t0
        elapsed = self.executor.step_s(plan, measured) if ran else measured
        self.last_step_modelled_s = elapsed if ran and self.config.sim is not None else 0.0
        if unstarved or plan.num_prefill_tokens >= (
                self.config.scheduler.token_budget - len(plan.decodes)) // 2:
            # a step measures the prefill rate when prefill filled half its budget, or gave every
            # queued prompt its whole chunk (a lone long prompt's steps count too)
            self.scheduler.prefill_rate.observe(plan.num_prefill_tokens, elapsed)
        self._decode_rate.observe(len(plan.decodes), elapsed)
        self._count(plan, elapsed, t1 - t0)
        self._record(plan, start, gap, ran or bool(plan.preempted), self.last_step_modelled_s)
        if self.last_step is not None:   # the step model (decode protection) learns its time
            self.scheduler.observe_step(plan, self.last_step.duration_s)
        return outputs

    def cancel(self, request_id: str, sample: int | None = None) -> bool:
        """Cancel now: frees every page the request (every sample of it, or only sample `sample`
        of its n) holds before returning. True if it was live. A sample ended alone sends its
        last output with finish_reason "abort"; the request's other samples go on. A sample
        not forked yet (a decode-role request awaiting its KV) is ended as it forks."""
        if sample is not None:
            return self._cancel_sample(request_id, sample)
        live = False
        for rid in [request_id, *self._samples.get(request_id, ())]:
            req = self.scheduler.cancel(rid)
            if req is not None and rid in self._states:
                self._pending.append(self._delta(req))
                live = True
        return live

    def _cancel_sample(self, request_id: str, sample: int) -> bool:
        rid = request_id if sample == 0 else f"{request_id}#{sample}"
        if sample > 0 and request_id not in self._samples:    # not forked (yet)
            parent = self._states.get(request_id)
            if parent is None or not 0 < sample < parent.req.params.n:
                return False
            self._doomed.setdefault(request_id, set()).add(rid)
            return True
        req = self.scheduler.cancel(rid)
        if req is None or rid not in self._states:
            return False
        self._pending.append(self._delta(req))
        return True

    def close(self) -> None:
        """Stop the tensor-parallel follower ranks, if any (they also exit when this process does)."""
        self.executor.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pending)

    def stream(self) -> Iterator[TokenOutput]:
        """Drive the engine until idle, yielding every delta as it is produced."""
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 **kwargs) -> list[CompletionOutput]:
        """Run prompts to completion; results in prompt order, a request's n samples in index
        order."""
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        results: dict[tuple[str, int], CompletionOutput] = {}
        for prompt, p in zip(prompts, plist):
            rid = self.add_request(prompt, p, **kwargs)
            req = self.scheduler.requests[rid]
            for index in range(max(1, req.params.n)):
                results[rid, index] = CompletionOutput(rid, list(req.prompt_token_ids), index=index)
        for out in self.stream():
            if (out.request_id, out.index) in results:
                results[out.request_id, out.index].add(out)
        return list(results.values())

    def stats(self) -> EngineStats:
        running = self.scheduler.running.values()
        return EngineStats(
            num_queued=self.scheduler.num_queued(), num_running=len(self.scheduler.running),
            num_decoding=sum(1 for r in running if r.is_decoding),
            num_waiting_for_kv=sum(1 for r in self.scheduler.requests.values()
                                   if r.status == Status.WAITING_FOR_KV),
            kv_blocks_total=self.pool.num_blocks, kv_blocks_free=self.pool.num_free,
            kv_blocks_used=self.pool.num_used, kv_blocks_reserved=self.pool.num_reserved,
            kv_blocks_cached=self.pool.num_cached,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens(),
            prefill_tokens_per_s=self.scheduler.prefill_rate.rate or 0.0,
            decode_tokens_per_s=self._decode_rate.rate or 0.0, last_step_s=self._last[0],
            last_schedule_s=self._last[1], last_prepare_s=self._last[2],
            oldest_queued_s=self._oldest_queued_s(), tenants=self.scheduler.tenant_shares(),
            num_waiting_for_decode_slot=self.scheduler.num_waiting_for_decode_slot,
            prefill_tokens_ahead=self.scheduler.prefill_tokens_ahead(),
            prefill_queues=self.scheduler.prefill_queues(),
            decode_context_tokens=sum(r.num_tokens for r in running if r.is_decoding),
            max_running=self.config.scheduler.max_running,
            max_prefill_attention=self.config.scheduler.max_prefill_attention,
            prefill_step_tokens_ahead=self.scheduler.prefill_step_tokens_ahead(),
            prefill_prompts=queued_prompts(self.scheduler),
            prefill_computed=queued_computed(self.scheduler), **self._counters)

    def _oldest_queued_s(self) -> float:
        arrival = self.scheduler.oldest_queued_arrival()
        return 0.0 if arrival is None else max(0.0, self.clock() - arrival)

    # ------------------------------------------------- disaggregated roles' API
    def reserve_remote(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                       request_id: str, tenant: str | None = None,
                       traffic_class: str | None = None) -> list[int] | None:
        """Decode role: reserve KV for a request prefilled elsewhere. Returns the blocks its
        prompt KV must be written into, or None if this engine cannot back it."""
        req = self._make_request(list(prompt_token_ids), params, tenant, traffic_class, request_id)
        blocks = self.scheduler.add_remote(req)
        if blocks is None:
            self._forget(req.request_id)
            del self._left[req.request_id]
        return blocks

    def start_decode(self, request_id: str, first_token: int,
                     more_first_tokens: Sequence[int] = ()) -> None:
        """Decode role: the prompt's KV already sits in the reserved blocks (a KV transport wrote
        it); start decoding from the prefill worker's first token. n > 1: `more_first_tokens`
        are samples 1..n-1's first tokens; they fork here, sharing the prompt's blocks."""
        req = self.scheduler.requests.get(request_id)
        if request_id not in self._states or req is None:
            raise UnknownRequestError(request_id)
        if len(more_first_tokens) != max(1, req.params.n) - 1:
            raise ValueError(f"{request_id}: n={req.params.n} needs {req.params.n - 1} more first "
                             f"tokens, got {len(more_first_tokens)}")
        samples = list(zip(self._new_samples(req), more_first_tokens))
        self._copy_blocks(self.scheduler.kv_arrived(request_id, first_token, samples))
        if self._ready_since is None:
            self._ready_since = self.clock()
        for r, token in [(req, first_token), *samples]:   # the prefill worker streamed them
            self._states[r.request_id].seed_first_token(token)
            if r.is_finished:
                self._pending.append(self._delta(r))
        self._end_doomed(request_id)

    def release(self, request_id: str) -> None:
        """Prefill role: the KV has been exported; free its pages."""
        self.scheduler.release(request_id)

    # ---------------------------------------------------------------- internals
    def _make_request(self, prompt, params, tenant, traffic_class, request_id) -> Request:
        params = params or SamplingParams()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._states:
            raise DuplicateRequestError(f"request id {rid!r} is already in use")
        ids, tenant_cfg, cls = self.validator.validate(prompt, params, tenant, traffic_class)
        params = clamp_to_output_cap(params, cls)
        eos = frozenset(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= self.tokenizer.eos_token_ids
        req = Request(rid, tenant_cfg.name, cls, params, ids, self.clock(), eos_token_ids=eos)
        self._states[rid] = OutputState(req, self._text_tokenizer, self.config.detokenize)
        self._generators[rid] = self.executor.new_generator(params.seed)
        self._left[rid] = 1                       # its samples join at the fork
        return req

    def _execute(self, plan: SchedulerOutput) -> list[TokenOutput]:
        sampling_chunks = [c for c in plan.chunks if c.sample]
        sampling = [c.request for c in sampling_chunks]
        # n > 1: a request sampling its first token forks; each new sample draws its first token
        # from the same row as its parent with its own generator (extra rows after the batch's)
        forking = {r.request_id: self._new_samples(r) for r in sampling if self._forks_now(r)}
        samples = [c for r in sampling for c in forking.get(r.request_id, ())]
        sources = sampling_chunks + [c for c in sampling_chunks
                                     for _ in forking.get(c.request.request_id, ())]
        drawers = sampling + samples
        sampled, prompt_lps = self.executor.execute(
            plan, drawers, sources, [self._generators[r.request_id] for r in drawers])
        for rid, lps in prompt_lps:
            self._states[rid].prompt_logprobs.extend(lps)
        firsts = dict(zip((c.request_id for c in samples), sampled[len(sampling):]))
        advanced = self.scheduler.update(
            plan, [s.token_id for s in sampled[:len(sampling)]],
            {rid: [(c, firsts[c.request_id].token_id) for c in cs] for rid, cs in forking.items()})
        self._copy_blocks(plan.block_copies)
        for req, s in [*zip(sampling, sampled), *((c, firsts[c.request_id]) for c in samples)]:
            stop = self._states[req.request_id].on_token(s.token_id, s)
            if stop is not None and not req.is_finished:
                self.scheduler.finish(req, Status.FINISHED_STOPPED, stop_reason=stop)
        outputs = [self._delta(r) for r in advanced]
        for rid in forking:
            self._end_doomed(rid)
        return outputs

    def _forks_now(self, req: Request) -> bool:
        return req.params.n > 1 and req.num_output_tokens == 0 and req.index == 0

    def _new_samples(self, req: Request) -> list[Request]:
        """Samples 1..n-1 of `req` (n > 1), each with its own output state and generator: with a
        seed, sample i draws from seed + i (vLLM's ParentRequest rule; sample 0 is `req`)."""
        p, samples = req.params, []
        for i in range(1, max(1, p.n)):
            params = replace(p, n=1, seed=None if p.seed is None else p.seed + i,
                             prompt_logprobs=None)     # the prompt's are sample 0's
            child = Request(f"{req.request_id}#{i}", req.tenant, req.traffic_class, params,
                            req.prompt_token_ids, req.arrival_time, eos_token_ids=req.eos_token_ids,
                            index=i, parent_id=req.request_id,
                            first_scheduled_time=req.first_scheduled_time,
                            num_cached_tokens=req.num_cached_tokens)
            self._states[child.request_id] = OutputState(child, self._text_tokenizer,
                                                         self.config.detokenize)
            self._generators[child.request_id] = self.executor.new_generator(params.seed)
            samples.append(child)
        self._samples[req.request_id] = [c.request_id for c in samples]
        self._left[req.request_id] += len(samples)
        return samples

    def _end_doomed(self, request_id: str) -> None:
        """End the samples cancelled before `request_id` forked them (now they exist)."""
        for rid in self._doomed.pop(request_id, ()):
            req = self.scheduler.cancel(rid)
            if req is not None and rid in self._states:
                self._pending.append(self._delta(req))

    def _copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        self.executor.copy_blocks(copies)

    def _delta(self, req: Request) -> TokenOutput:
        """The request's news under the id callers know (a sample's: its request's, and its
        index). A sample's last output has its finish_reason; `finished` is set on the last
        output of the request's last sample only."""
        out = self._states[req.request_id].delta()
        if out.prefilled and req.index == 0:  # blocks held until release()
            out.block_ids = list(self.pool.block_table(req.request_id))
        if out.finished:
            self._forget(req.request_id)
            rid = req.external_id
            self._left[rid] -= 1
            out.finished = self._left[rid] == 0
            if out.finished:
                del self._left[rid]
                self._samples.pop(rid, None)
        return out

    def _forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._doomed.pop(request_id, None)
        self._generators.pop(request_id, None)

    def _count(self, plan: SchedulerOutput, step_s: float, sched_s: float) -> None:
        self._counters["steps"] += 1
        self._counters["prefill_tokens"] += plan.num_prefill_tokens
        self._counters["decode_tokens"] += len(plan.decodes)
        self._counters["preemptions"] += len(plan.preempted)
        self._counters["rejections"] += len(plan.rejected)
        prep = self.executor.last_prepare_s if plan.chunks else 0.0
        self._last = (step_s, sched_s, prep)

    def _record(self, plan: SchedulerOutput, start: float, gap: float, ran: bool,
                step_s: float) -> None:
        """Set last_step (None for a step that only flushed outputs) and when work next waits
        from: this step's end if work is left, else (idle) its next arrival. A simulated step
        ends at its start + its modelled time (its caller paces the clock to that)."""
        end = self.clock() if self.config.sim is None else start + step_s
        self.last_step = StepRecord(
            prefill_tokens=plan.num_prefill_tokens, decode_tokens=len(plan.decodes),
            num_prefill_seqs=len(plan.prefills), num_decode_seqs=len(plan.decodes),
            duration_s=end - start if self.config.sim is None else step_s, gap_s=gap,
            # a decode chunk attends over its whole context: positions [0, start_pos] inclusive
            kv_read_bytes=sum(c.start_pos + 1 for c in plan.decodes) * self.kv_bytes_per_token,
            prefix_queries=plan.prefix_queries, prefix_hits=plan.prefix_hits,
            preemptions=len(plan.preempted),
            prefill_chunks=[(c.request.request_id, c.num_tokens) for c in plan.prefills],
            attention_pairs=sum(attention_pairs(c.start_pos, c.num_tokens) for c in plan.prefills)
            + sum(c.start_pos + 1 for c in plan.decodes),
            **_by_class(plan.prefills),
        ) if ran else None
        if not self.has_unfinished():
            self._ready_since = None
        elif ran or self._ready_since is None:
            self._ready_since = end


PUBLISHED_PROMPTS = 64   # queued prompts of one tenant a worker lists in its stats, at most


def queued_prompts(scheduler) -> dict[tuple[str, str], list[int]]:
    """(class, tenant) -> the tokens not yet computed of each of its queued prompts, in the
    order its queue is served (the first PUBLISHED_PROMPTS)."""
    return {(cls, tenant): [r.num_uncomputed_tokens for r in itertools.islice(q, PUBLISHED_PROMPTS)]
            for cls, qs in scheduler.queues.items() for tenant, q in qs.items() if q}


def queued_computed(scheduler) -> dict[tuple[str, str], list[int]]:
    """(class, tenant) -> the tokens already computed of each prompt `queued_prompts` lists."""
    return {(cls, tenant): [r.num_computed_tokens for r in itertools.islice(q, PUBLISHED_PROMPTS)]
            for cls, qs in scheduler.queues.items() for tenant, q in qs.items() if q}


def clamp_to_output_cap(params: SamplingParams, cls) -> SamplingParams:
    """max_tokens past the class's output cap is clamped to it (the request then ends with
    finish_reason "length" at the cap). This is what makes the reservation, which covers
    min(max_tokens, output_cap) output tokens under `reserve` (admission.bounded_output), cover
    every token the request can ever decode."""
    if params.max_tokens <= cls.output_cap:
        return params
    return replace(params, max_tokens=cls.output_cap)


def _make_executor(config: EngineConfig, model_dir: str, model_config: ModelConfig,
                   tokenizer: Tokenizer | None, kv_alloc, step_timer):
    """The model's executor, or (config.sim set) the simulated one: imported only when used,
    so a simulated core never imports the model's modules."""
    if config.sim is not None:
        from services.engine.sim_engine import SimExecutor  # noqa: PLC0415
        return SimExecutor(config, model_config, tokenizer, kv_alloc, step_timer)
    from services.engine.model_executor import ModelExecutor  # noqa: PLC0415
    return ModelExecutor(config, model_dir, kv_alloc)


def has_tokenizer(model_dir: str) -> bool:
    return os.path.exists(os.path.join(model_dir, "tokenizer.json"))


def engine_config(model: str = "tiny", **overrides) -> EngineConfig:
    """An EngineConfig with scheduler overrides given flat (token_budget=..., role=...)."""
    sched_keys = SchedulerConfig.__dataclass_fields__.keys()
    sched = {k: overrides.pop(k) for k in list(overrides) if k in sched_keys}
    cfg = EngineConfig(model=model, **overrides)
    return replace(cfg, scheduler=replace(cfg.scheduler, **sched)) if sched else cfg
