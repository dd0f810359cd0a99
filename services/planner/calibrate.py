"""`kvfleet sim calibrate`: measure the real in-process engine's step time by batch composition.

The real `LLMEngine` (real scheduler, block pool and model on this machine's CPU) runs a grid of
scenarios. A scenario starts `decodes` requests with `context`-token prompts, lets them decode
alone for a few steps (pure decode batches), then adds `prompts` whose prefill chunks (at
`chunk_size`, so at every offset of the prompt) run beside the decodes (mixed batches) and finally
alone. Every step that ran the model is one sample: its `BatchShape`, read from the engine's
public state just before the step (each request's computed tokens) and the step's record after
it, and its measured duration (`engine.last_step.duration_s`). The samples are fitted by
`services/planner/profile.py`.
"""
from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from services.planner.profile import StepProfile, fit_profile
from services.planner.step_time import BatchShape

WARMUP_STEPS = 8           # the first steps of a fresh engine pay for torch's lazy setup


@dataclass(frozen=True)
class Scenario:
    chunk_size: int
    decodes: int                 # sequences decoding through the scenario
    context: int                 # their prompt length
    prompts: tuple[int, ...]     # prompt lengths prefilled beside (then after) the decodes
    decode_steps: int = 6        # pure decode steps before the prompts arrive


@dataclass(frozen=True)
class Grid:
    chunk_sizes: tuple[int, ...]
    scenarios: tuple[tuple[int, int, tuple[int, ...]], ...]   # (decodes, context, prompts)
    decode_steps: int
    repeats: int                 # runs of each scenario; a step's time is its median over them

    def __iter__(self) -> Iterator[Scenario]:
        for chunk in self.chunk_sizes:
            for decodes, context, prompts in self.scenarios:
                yield Scenario(chunk, decodes, context, prompts, self.decode_steps)


FULL = Grid(chunk_sizes=(256,), decode_steps=6, repeats=2, scenarios=(
    (1, 64, (600,)), (8, 256, (1000,)), (16, 128, (300, 200)), (32, 512, ()),
    (4, 1024, (500,)), (0, 0, (2000,)), (0, 0, (200, 90, 40)),
))
QUICK = Grid(chunk_sizes=(256,), decode_steps=3, repeats=2, scenarios=(
    (1, 64, (512,)), (8, 128, (300,)), (0, 0, (600, 40)),
))


@dataclass(frozen=True)
class CalibrateConfig:
    model: str = "tiny"
    threads: int | None = None      # torch intra-op threads; None: the engine's (EngineConfig.torch_threads)
    quick: bool = False
    seed: int = 0
    stat: str = "median"            # a step's time over the repeats: median | min
    max_running: int = 128
    token_budget: int = 2048


def calibrate(cfg: CalibrateConfig, progress: Callable[[str], None] | None = None) -> StepProfile:
    """Measure the grid on the real engine and fit it."""
    import torch  # noqa: PLC0415

    if cfg.stat not in ("median", "min"):
        raise ValueError(f"unknown statistic {cfg.stat!r} (median | min)")
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    grid = QUICK if cfg.quick else FULL
    rng = np.random.default_rng(cfg.seed)
    samples: list[tuple[BatchShape, float]] = []
    dtype = ""
    for chunk in grid.chunk_sizes:
        engine = _engine(cfg, chunk)
        dtype = str(engine.kv_cache.dtype).removeprefix("torch.")   # auto: the model's
        _run(engine, Scenario(chunk, 4, 64, (chunk * 2,), 2), rng, WARMUP_STEPS)  # discarded
        scenarios = [s for s in grid if s.chunk_size == chunk]
        runs: dict[Scenario, list] = {sc: [] for sc in scenarios}
        for _ in range(grid.repeats):      # interleaved: a burst of load spreads over scenarios
            for sc in scenarios:
                runs[sc].append(_run(engine, sc, rng))
        for sc in scenarios:
            got = _combine_runs(runs[sc], cfg.stat)
            samples += got
            if progress:
                progress(f"chunk {chunk}: {sc.decodes} decodes at {sc.context}, prompts "
                         f"{list(sc.prompts)}: {len(got)} steps x {grid.repeats}")
        engine.close()
    return fit_profile(samples, model=cfg.model, dtype=dtype, threads=torch.get_num_threads(),
                       machine=machine_facts(),
                       notes=f"{'quick' if cfg.quick else 'full'} grid, {len(samples)} step shapes, "
                             f"{cfg.stat} of {grid.repeats} runs each")


def _engine(cfg: CalibrateConfig, chunk: int):
    from services.engine.engine import LLMEngine, engine_config  # noqa: PLC0415
    return LLMEngine(engine_config(
        cfg.model, enable_prefix_caching=False, token_budget=max(cfg.token_budget, chunk),
        chunk_size=chunk, max_running=cfg.max_running, reject_late=False,
        max_prefill_attention=0, torch_threads=cfg.threads or 0))


def _run(engine, sc: Scenario, rng: np.random.Generator,
         warmup: int = 0) -> list[tuple[BatchShape, float]]:
    """One scenario to completion; its measured steps (the first `warmup` dropped)."""
    from services.engine.sampling_params import SamplingParams  # noqa: PLC0415

    vocab = engine.model_config.vocab_size
    # decodes outlast the prompts' prefill: their chunks, plus the pure-decode lead-in and a tail
    prefill_steps = sum(-(-p // sc.chunk_size) for p in sc.prompts)
    decode_len = sc.decode_steps + prefill_steps + 4
    samples: list[tuple[BatchShape, float]] = []

    def add(length: int, max_tokens: int) -> None:
        ids = rng.integers(16, vocab, size=length).tolist()
        engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                               temperature=0.0))

    def step() -> None:
        shape = _shape_before_step(engine)
        engine.step()
        rec = engine.last_step
        if rec is not None:
            samples.append((_with_chunks(shape, rec, engine), rec.duration_s))

    for _ in range(sc.decodes):
        add(sc.context, decode_len)
    while any(not r.is_decoding for r in engine.scheduler.running.values()) or \
            engine.scheduler.num_queued():
        step()
    for _ in range(sc.decode_steps):
        step()
    for p in sc.prompts:
        add(p, 2)
    while engine.has_unfinished():
        step()
    return samples[warmup:]


def _combine_runs(runs: list[list[tuple[BatchShape, float]]],
                  stat: str) -> list[tuple[BatchShape, float]]:
    """Step i of every run of a scenario has the same shape (the same lengths, chunked alike):
    its time is the median (or the minimum) over the runs, which a burst of load on a shared
    machine moves less than any one run."""
    first = runs[0]
    if any([b for b, _ in run] != [b for b, _ in first] for run in runs):
        raise RuntimeError("calibration: runs of one scenario planned different batches")
    pick = np.min if stat == "min" else np.median
    return [(b, float(pick([run[i][1] for run in runs]))) for i, (b, _) in enumerate(first)]


def _shape_before_step(engine) -> dict[str, tuple[int, bool]]:
    """Per live request: (tokens computed, decoding) just before a step."""
    return {rid: (r.num_computed_tokens, r.is_decoding)
            for rid, r in engine.scheduler.requests.items()}


def _with_chunks(before: dict[str, tuple[int, bool]], rec, engine) -> BatchShape:
    """The step's BatchShape: its prefill chunks from the record, at the offsets their requests
    had computed before it; the decodes' contexts from the requests decoding before it (reserve
    admission never preempts, so every one of them decoded). Checked against the record."""
    chunks = tuple((n, before.get(rid, (0, False))[0]) for rid, n in rec.prefill_chunks)
    contexts = tuple(computed + 1 for computed, decoding in before.values() if decoding)
    if len(contexts) != rec.num_decode_seqs or \
            sum(contexts) * engine.kv_bytes_per_token != rec.kv_read_bytes:
        raise RuntimeError("calibration: the step's decodes differ from the requests that were "
                           "decoding before it")
    return BatchShape(prefill_chunks=chunks, decode_contexts=contexts)


def machine_facts() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "loadavg_1m": os.getloadavg()[0], "python": platform.python_version()}
