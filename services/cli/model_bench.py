"""Quick executor timings on random weights (not a test): python -m services.cli.model_bench

Default shape is the test suite's config A (hidden 256, 4 layers, 8/2 heads, llama3 RoPE, vocab 4096).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.engine.model.batch import SeqChunk, prepare_inputs
from services.engine.model.config import ModelConfig
from services.engine.model.kv_cache import KVCache
from services.engine.model.llama import LlamaForward
from services.engine.model.loader import expected_shapes, fused_state_dict
from services.engine.model.runner import ModelRunner

CONFIG_A = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
            "max_position_embeddings": 40960, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
BLOCK = 16


def random_model(config: ModelConfig, device: str) -> LlamaForward:
    gen = torch.Generator().manual_seed(0)
    shapes = expected_shapes(config, with_lm_head=True)
    state = fused_state_dict(config, lambda n: (torch.randn(shapes[n], generator=gen) * 0.05).to(device), True)
    model = LlamaForward(config, tie_word_embeddings=False)
    model.load_state_dict(state, strict=True, assign=True)
    return model


def timed(fn, repeats: int) -> float:
    """Median wall time in ms (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def decode_chunks(batch: int, context: int) -> list[SeqChunk]:
    blocks = -(-(context + 1) // BLOCK)
    return [SeqChunk([7], context, list(range(i * blocks, (i + 1) * blocks)), (0,)) for i in range(batch)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    config = ModelConfig.from_dict(CONFIG_A)
    runner = ModelRunner(random_model(config, args.device), KVCache(config, 2400, BLOCK, torch.float32, args.device))
    print(f"torch threads {torch.get_num_threads()}, device {args.device}")
    for context in (128, 512, 1024):
        ms = timed(lambda: runner.execute(decode_chunks(32, context)), args.repeats)
        print(f"decode step, batch 32, context {context}: {ms:.2f} ms")
    for start in (0, 8192, 32256):
        chunk = [SeqChunk([7] * 512, start, list(range(-(-(start + 512) // BLOCK))), (511,))]
        ms = timed(lambda: runner.execute(chunk), max(3, args.repeats // 4))
        print(f"prefill chunk of 512 at start_pos {start}: {ms:.1f} ms")
    chunks = decode_chunks(256, 2000)
    ms = timed(lambda: prepare_inputs(chunks, BLOCK), args.repeats)
    print(f"prepare_inputs, 256 decodes: {ms:.2f} ms")


if __name__ == "__main__":
    main()
