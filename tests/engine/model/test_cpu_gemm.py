"""oneDNN projections with weights packed at start-up (services/engine/model/cpu_gemm.py): what each
cpu_gemm mode packs, and that a packed model computes what the plain one does."""
from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.model import KVCache, ModelRunner, SeqChunk, load_model
from services.engine.model.cpu_gemm import can_pack, prepack

BLOCK = 16

pytestmark = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                                reason="this torch build has no oneDNN")


def batch() -> list[SeqChunk]:
    """A prefill chunk of 20 tokens and one of 9, each asking for its last row's logits."""
    return [SeqChunk(list(range(30, 50)), 0, [0, 1], [19]), SeqChunk(list(range(60, 69)), 0, [2], [8])]


def logits(model, cpu_gemm: str) -> torch.Tensor:
    return ModelRunner(model, KVCache(model.config, 8, BLOCK, model.dtype), "torch",
                       cpu_gemm=cpu_gemm).execute(batch())


def packed_weights(model) -> int:
    return sum(getattr(m, "packed", None) is not None for m in model.modules()) + (
        model.head_packed is not None)


def test_a_bfloat16_model_packed_by_default_gives_the_plain_models_bits(tiny_model_dir):
    plain = logits(load_model(tiny_model_dir, dtype="bfloat16"), "torch")
    model = load_model(tiny_model_dir, dtype="bfloat16")
    packed = logits(model, "auto")
    assert packed_weights(model) == 4 * model.config.num_layers + 1   # qkv, o, gate_up, down; head
    assert torch.equal(packed, plain)


def test_float32_is_packed_only_when_asked_and_then_agrees_to_float32_rounding(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype="float32")
    plain = logits(model, "auto")
    assert packed_weights(model) == 0               # auto keeps float32 on F.linear (MKL)
    packed = logits(model, "onednn")
    assert packed_weights(model) == 4 * model.config.num_layers + 1
    diff = (packed.log_softmax(-1) - plain.log_softmax(-1)).abs().max().item()
    assert diff < 1e-4
    assert torch.equal(packed.argmax(-1), plain.argmax(-1))


def test_packing_twice_packs_nothing_new_and_torch_mode_packs_nothing(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype="bfloat16")
    assert prepack(model, "torch") == 0
    assert prepack(model) == 4 * model.config.num_layers + 1
    assert prepack(model) == 0


def test_an_unknown_mode_is_refused_with_the_modes_named(tiny_model_dir):
    with pytest.raises(ValueError, match="auto|onednn|torch"):
        prepack(load_model(tiny_model_dir), "fast")
    with pytest.raises(ValueError, match="unknown cpu_gemm 'fast'"):
        EngineConfig(cpu_gemm="fast")


def test_the_mode_travels_to_an_engine_core_with_the_config():
    """A fleet's engine core gets its EngineConfig as msgpack (YAML key `cpu_gemm`)."""
    import msgspec
    wire = msgspec.msgpack.encode(EngineConfig(cpu_gemm="onednn"))
    assert msgspec.msgpack.decode(wire, type=EngineConfig).cpu_gemm == "onednn"
