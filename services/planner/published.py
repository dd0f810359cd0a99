"""Published serving measurements the cost model's one set of constants is checked against.

Each point rebuilds the setup it was measured on (model, GPU, TP, precision, lengths, batch) and
asks the cost model for the same figure:

1. NVIDIA NIM, Llama-3.3-70B FP8 on 2 x H100 (TP2), 5,000 in / 500 out, one request:
   TTFT 407 ms (one 5,000-token prefill) and ITL 18.6 ms (a batch-1 decode step at the
   generation's middle, context 5,250).
2. vLLM's CI latency test, Llama-3-70B bf16 on 4 x H200 (TP4), batch 8, 32 in / 128 out:
   ~16 ms per output token = (the 8 x 32-token prefill + 127 decode steps) / 128.
3. TensorRT-LLM, Llama-3.3-70B FP8 on 1 x H200, 1,000 in / 1,000 out: 2,909 output tok/s.
   Assumed batch: the largest whose KV fits at full length (2,000 tokens each). In-flight
   batching's steady state: every iteration decodes the batch at mid-generation context
   (1,500) and prefills the prompts of the requests that replace finished ones (batch x
   1,000 / 1,000 tokens per iteration, half-way through their prompts on average).
   tok/s = batch / step time.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.planner.capacity import CostModel
from services.planner.constants import Constants
from services.planner.step_time import BatchShape

TOLERANCE = 0.15


@dataclass(frozen=True, slots=True)
class CheckPoint:
    name: str
    source: str
    unit: str
    published: float
    model: float
    assumption: str = ""

    @property
    def error(self) -> float:
        """Signed relative error of the model against the published figure."""
        return self.model / self.published - 1

    @property
    def ok(self) -> bool:
        return abs(self.error) <= TOLERANCE


def check_points(constants: Constants) -> list[CheckPoint]:
    return [*_nim_h100(constants), _vllm_h200(constants), _trtllm_h200(constants)]


def _nim_h100(c: Constants) -> list[CheckPoint]:
    m = CostModel.for_target("llama-3-70b", "h100", tp=2, dtype="fp8", constants=c)
    source = "NVIDIA NIM, Llama-3.3-70B FP8, 2xH100 TP2, 5000 in / 500 out, 1 request"
    return [CheckPoint("TTFT", source, "ms", 407.0, 1e3 * m.prefill_s(5000)),
            CheckPoint("ITL", source, "ms", 18.6, 1e3 * m.decode_step_s(1, 5250))]


def _vllm_h200(c: Constants) -> CheckPoint:
    m = CostModel.for_target("llama-3-70b", "h200", tp=4, dtype="bf16", constants=c)
    batch, prompt, output = 8, 32, 128
    total = m.step_s(BatchShape(prefill_chunks=((prompt, 0),) * batch))
    total += sum(m.decode_step_s(batch, prompt + k) for k in range(1, output))
    return CheckPoint("latency per output token", "vLLM CI latency test, Llama-3-70B bf16, 4xH200 "
                      "TP4, batch 8, 32 in / 128 out", "ms", 16.0, 1e3 * total / output)


def _trtllm_h200(c: Constants) -> CheckPoint:
    m = CostModel.for_target("llama-3-70b", "h200", tp=1, dtype="fp8", constants=c)
    prompt, output = 1000, 1000
    batch = m.concurrent_contexts(prompt + output)
    refill = -(-batch * prompt // output)
    step = m.step_s(BatchShape(prefill_chunks=((refill, prompt // 2),),
                               decode_contexts=(prompt + output // 2,) * batch))
    return CheckPoint("output throughput", "TensorRT-LLM, Llama-3.3-70B FP8, 1xH200, 1000 in / "
                      "1000 out", "tok/s", 2909.0, batch / step,
                      f"batch {batch} (largest whose 2000-token KV fits), {refill} prefill tokens "
                      "per iteration")
