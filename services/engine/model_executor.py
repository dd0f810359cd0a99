"""The real engine's executor (services/engine/executor.py): loads the model, holds its paged KV
cache, runs each planned batch through the ModelRunner and samples with the Sampler."""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from services.engine.config import EngineConfig
from services.engine.device import check_rank_devices, rank_device, resolve_device, use_cuda_graphs
from services.engine.model.batch import SeqChunk
from services.engine.model.cpu_malloc import keep_freed_memory
from services.engine.model.decode_graphs import DecodeGraphConfig, DecodeGraphRunner
from services.engine.model.kv_cache import KVCache, kv_bytes_per_token, kv_cache_shape, resolve_kv_dtype
from services.engine.model.loader import load_model
from services.engine.model.runner import ModelRunner
from services.engine.model.threads import set_engine_threads
from services.engine.request import Request
from services.engine.sampler import Sampler, TokenLogprob, make_generator, prompt_logprobs
from services.engine.scheduler import ScheduledChunk, SchedulerOutput
from services.engine.tp_ranks import TPLeader, drive, start_rank0

log = logging.getLogger(__name__)


class ModelExecutor:
    def __init__(self, config: EngineConfig, model_dir: str, kv_alloc=None) -> None:
        """kv_alloc(shape, dtype): memory for the cache (e.g. a shared file). With tensor
        parallelism N it is asked for all N ranks' caches at once, [N * num_layers, ...] rank-major
        (rank 0 keeps the first part); a kv_alloc with a `path` (the file it maps) lets each
        follower rank map its own part of that file (services/engine/tp_ranks.py)."""
        self.device = resolve_device(config.device)   # the model, the KV cache, the logits
        if self.device.type == "cpu":             # before loading: packing and ranks use them
            log.info("torch threads: %d", set_engine_threads(config.torch_threads))
        tp = config.tensor_parallel_size
        self.tp_leader: TPLeader | None = None   # rank 0 of config.tensor_parallel_size
        if tp > 1:                                # model.config is the rank's (its KV heads)
            check_rank_devices(self.device.type, tp)
            self.device = rank_device(self.device.type, 0)
            model, self.tp_leader = start_rank0(model_dir, config.dtype, tp, self.device)
        else:
            model = load_model(model_dir, dtype=config.dtype, device=self.device)
        try:
            self._build(config, model_dir, model, kv_alloc)
        except BaseException:
            self.close()                          # no follower rank outlives a failed start
            raise

    def _build(self, config: EngineConfig, model_dir: str, model, kv_alloc) -> None:
        tp = config.tensor_parallel_size
        # the cache's element type: the model's, or --kv-cache-dtype (fp8: half of bf16's bytes,
        # so twice the blocks in the same kv_cache_mib; every block count below follows from it)
        dtype = resolve_kv_dtype(config.kv_cache_dtype, next(model.parameters()).dtype)
        self.num_blocks = config.num_blocks or max(1, (config.kv_cache_mib << 20) // (
            kv_bytes_per_token(model.config, dtype) * config.block_size))
        shape = kv_cache_shape(model.config, self.num_blocks, config.block_size)
        kv_data = None
        if kv_alloc is not None:                  # every rank's part; rank 0's is the first
            kv_data = kv_alloc((shape[0] * tp, *shape[1:]), dtype)[:shape[0]]
        if kv_data is not None and kv_data.device != self.device:
            raise ValueError(f"the KV allocator gave memory on {kv_data.device}, the model is on "
                             f"{self.device}")
        k_scale, v_scale = config.kv_cache_scales
        self.kv_cache = KVCache(model.config, self.num_blocks, config.block_size, dtype,
                                device=self.device, data=kv_data, k_scale=k_scale, v_scale=v_scale)
        self.kv_bytes_per_token = kv_bytes_per_token(model.config, dtype)  # all layers, K+V (a rank's)
        self.runner = ModelRunner(model, self.kv_cache, backend=config.attention_backend,
                                  cpu_gemm=config.cpu_gemm)
        if use_cuda_graphs(config.cuda_graphs, self.device):
            self.runner = self._padded_decodes(config, model)
        if self.tp_leader is not None:
            self.runner = drive(self.runner, self.tp_leader, model_dir, config,
                                getattr(kv_alloc, "path", "") if kv_alloc is not None else "")
        self.sampler = Sampler(config.seed, config.logprobs_mode)
        self.last_prepare_s = 0.0
        self._table = None
        if self.device.type == "cpu":   # weights and cache exist: what is freed now is a step's
            keep_freed_memory()

    def _padded_decodes(self, config: EngineConfig, model) -> ModelRunner | DecodeGraphRunner:
        """The runner whose decode-only steps run at fixed batch sizes (graphs on CUDA with the
        Triton backend); the plain runner under tensor parallelism, whose followers' forwards
        must match rank 0's shapes step by step."""
        if config.tensor_parallel_size > 1:
            log.info("cuda graphs: off under tensor parallelism (each step runs eagerly)")
            return self.runner
        capture = self.device.type == "cuda" and self.runner.fused_layers
        if self.device.type == "cuda" and not capture:
            log.info("cuda graphs: the torch attention backend runs padded decode steps eagerly")
        runner = DecodeGraphRunner(self.runner, DecodeGraphConfig(
            max_batch=config.scheduler.max_running,
            max_model_len=config.max_model_len or model.config.max_position_embeddings,
            capture=capture))
        if not capture:
            log.info("cuda graphs on %s: decode steps padded to batch sizes %s, run eagerly",
                     self.device, ",".join(map(str, runner.sizes)))
        return runner

    def new_generator(self, seed: int | None):
        return make_generator(seed)

    def bind(self, block_table) -> None:
        """The block pool's block_table(request_id) (the engine builds the pool after us)."""
        self._table = block_table

    def execute(self, plan: SchedulerOutput, drawers: Sequence[Request],
                sources: Sequence[ScheduledChunk], generators: Sequence[object]
                ) -> tuple[list[TokenLogprob], list[tuple[str, list[TokenLogprob]]]]:
        t0 = time.perf_counter()
        chunks = plan.chunks
        seq_chunks = [SeqChunk(c.token_ids, c.start_pos, self._table(c.request.request_id),
                               c.logit_rows) for c in chunks]
        build_s = time.perf_counter() - t0
        logits = self.runner.execute(seq_chunks)
        self.last_prepare_s = build_s + self.runner.last_prepare_s
        rows, row, prompt_lps = {}, 0, []
        for c in chunks:
            if c.num_prompt_logprob_rows:
                prompt_lps.append((c.request.request_id,
                                   _prompt_logprobs(c, logits[row:row + c.num_prompt_logprob_rows])))
            row += len(c.logit_rows)
            if c.sample:
                rows[id(c)] = row - 1
        sampled = self.sampler(logits[[rows[id(c)] for c in sources]], [r.params for r in drawers],
                               list(generators), list(drawers))
        return sampled, prompt_lps

    def step_s(self, plan: SchedulerOutput, measured_s: float) -> float:
        return measured_s

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """A forked sample's own copy of its prompt's partial last block (copy-on-write). In
        order, one at a time: a sample that ended at its first token gave its block back, and a
        later fork in the same step may have taken it (the later copy must win)."""
        for src, dst in copies:
            self.kv_cache.write_blocks([dst], self.kv_cache.read_blocks([src]))
        if copies and self.tp_leader is not None:   # each rank's cache holds its heads of the block
            self.tp_leader.copy_blocks(copies)

    def close(self) -> None:
        """Stop the tensor-parallel follower ranks, if any (they also exit when this process does)."""
        if self.tp_leader is not None:
            self.tp_leader.close()


def _prompt_logprobs(chunk: ScheduledChunk, logits) -> list[TokenLogprob]:
    req = chunk.request
    targets = req.token_ids[chunk.start_pos + 1:chunk.start_pos + 1 + len(logits)]
    return prompt_logprobs(logits, targets, req.params.prompt_logprobs)
