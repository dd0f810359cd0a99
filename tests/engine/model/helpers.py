"""Story helpers for the model executor tests: random HF checkpoints, block allocation, references."""
from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.engine.model import SeqChunk

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
CONFIG_A = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=40960,
                rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, tie_word_embeddings=False)
CONFIG_B = dict(vocab_size=4096, hidden_size=192, intermediate_size=384, num_hidden_layers=3,
                num_attention_heads=6, num_key_value_heads=3, head_dim=32, max_position_embeddings=4096,
                rope_theta=10000.0, tie_word_embeddings=True)


def hf_config(**overrides):
    """A LlamaConfig; overrides are deep-copied (LlamaConfig writes into the rope dict it is given).

    initializer_range 0.1: at 0.2 this model is so ill-conditioned in fp32 that transformers' own fp32
    log-probs differ from its fp64 ones by 2.3e-4; at 0.1 by 3e-5, and near-ties stay rare.
    """
    from transformers import LlamaConfig

    return LlamaConfig(initializer_range=0.1, rms_norm_eps=1e-5, **copy.deepcopy(overrides))


def make_checkpoint(out_dir: Path, seed: int, **overrides) -> Path:
    """A seeded random LlamaForCausalLM saved by transformers itself (safetensors, fp32)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(hf_config(**overrides)).save_pretrained(out_dir)
    return out_dir


def load_reference(model_dir: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_logprobs(hf_model, tokens: list[int]) -> torch.Tensor:
    """transformers' log_softmax over every position of one sequence: [len(tokens), vocab]."""
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def random_tokens(n: int, seed: int, vocab: int = 4096) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class ShuffledBlockIds:
    """Hands out distinct block ids in shuffled order, so block tables are never contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0):
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        assert len(taken) == n, "test block pool exhausted"
        return taken


@dataclass
class Seq:
    """One sequence as the scheduler would track it: tokens, computed count, block table."""

    tokens: list[int]
    pool: ShuffledBlockIds
    block_size: int
    computed: int = 0
    table: list[int] = field(default_factory=list)

    def chunk(self, n: int, rows: str = "all") -> SeqChunk:
        """The next n uncomputed tokens; rows: 'all' (prompt logprobs) | 'last' (sample) | 'none'."""
        start, end = self.computed, self.computed + n
        assert end <= len(self.tokens)
        needed = -(-end // self.block_size)
        self.table += self.pool.take(needed - len(self.table))
        self.computed = end
        logit_rows = {"all": range(n), "last": (n - 1,), "none": ()}[rows]
        return SeqChunk(self.tokens[start:end], start, list(self.table), tuple(logit_rows))
