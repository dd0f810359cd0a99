"""The tiny Llama on the Triton backend (attention, KV store, RMSNorm, RoPE, SiLU-mul kernels) gives
the torch backend's logits over chunked prefill and mixed decode/prefill steps, and the same greedy
tokens through `kvfleet generate --attention-backend triton`."""
from __future__ import annotations

import json

import pytest
import torch

from services.engine.model.triton_backend import TritonAttentionBackend
from services.engine.model import KVCache, ModelRunner, SeqChunk, TorchAttentionBackend, load_model
from services.engine.model.runner import make_attention_backend
from tests.kernels.helpers import DEVICE, ON_GPU

BLOCK = 16


@pytest.fixture(scope="module")
def tiny():
    """The `--model tiny` checkpoint (built once into the cache dir), shared with the CLI test."""
    from services.engine.engine import resolve_model_dir
    return load_model(resolve_model_dir("tiny"), device=DEVICE)


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Two sequences: 17- and 2-token first chunks (the first crosses a block), then a decode at
    position 17 beside a 3-token later chunk. Every interpreted kernel program costs ~10-30 ms here,
    so the batches stay this small."""
    a, b = list(range(300, 317)), list(range(400, 405))
    ta, tb = [7, 3], [11]                                           # shuffled block ids, not contiguous
    return [runner.execute([SeqChunk(a, 0, ta, (16,)), SeqChunk(b[:2], 0, tb, (1,))]),
            runner.execute([SeqChunk([42], 17, ta, (0,)), SeqChunk(b[2:], 2, tb, (0, 1, 2))])]


def test_runner_logits_match_torch_backend(tiny):
    torch_runner = ModelRunner(tiny, KVCache(tiny.config, 16, BLOCK, torch.float32, DEVICE), backend="torch")
    triton_runner = ModelRunner(tiny, KVCache(tiny.config, 16, BLOCK, torch.float32, DEVICE), backend="triton")
    assert isinstance(triton_runner.backend, TritonAttentionBackend) and triton_runner.fused_layers
    assert isinstance(torch_runner.backend, TorchAttentionBackend) and not torch_runner.fused_layers
    for got, expected in zip(_steps(triton_runner), _steps(torch_runner)):
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(triton_runner.kv_cache.data, torch_runner.kv_cache.data, atol=1e-5, rtol=1e-5)


def test_fp8_cache_matches_the_torch_backend(tiny):
    """KVCache(dtype="fp8") with per-tensor scales: both backends store the same bytes and read
    them back the same way."""
    caches = [KVCache(tiny.config, 16, BLOCK, "fp8", DEVICE, k_scale=0.5, v_scale=0.25) for _ in range(2)]
    torch_runner = ModelRunner(tiny, caches[0], backend="torch")
    triton_runner = ModelRunner(tiny, caches[1], backend="triton")
    for got, expected in zip(_steps(triton_runner), _steps(torch_runner)):
        torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    assert caches[1].data.dtype == torch.float8_e4m3fn
    assert torch.equal(caches[1].data.view(torch.uint8), caches[0].data.view(torch.uint8))


def test_backend_choice():
    cpu = torch.device("cpu")
    assert isinstance(make_attention_backend("auto", 8, cpu), TorchAttentionBackend)  # auto: triton on CUDA only
    if ON_GPU:
        assert isinstance(make_attention_backend("auto", 8, torch.device("cuda")), TritonAttentionBackend)
    else:
        assert isinstance(make_attention_backend("triton", 8, cpu), TritonAttentionBackend)  # interpreted here
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_attention_backend("flash", 8, cpu)


def test_triton_off_cuda_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA"):
        make_attention_backend("triton", 8, torch.device("cpu"))


@pytest.mark.skipif(ON_GPU, reason="LLMEngine keeps its model on the CPU: there triton is the interpreter")
def test_generate_gives_the_same_greedy_tokens(capsys):
    from services.cli.cli import build_parser
    outputs = {}
    for backend in ("torch", "triton"):
        args = build_parser().parse_args(["generate", "--model", "tiny", "--prompt", "Hello there", "--max-tokens",
                                          "3", "--json", "--attention-backend", backend])
        assert args.func(args) == 0
        outputs[backend] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(outputs["torch"]["token_ids"]) == 3
    assert outputs["triton"]["token_ids"] == outputs["torch"]["token_ids"]


def test_padded_decode_steps_on_the_triton_backend_give_the_unpadded_logits(tiny):
    """Decode steps padded to fixed sizes (services/engine/model/decode_graphs.py) through the
    Triton kernels: three sequences run at size 4 (one padding row, slot -1, which the KV store
    skips), then one alone at size 1. Interpreted here; on the GPU (gpu_check.sh, the prepared
    run's kernel tests) each size is captured as a CUDA graph and replayed."""
    from services.engine.model.decode_graphs import DecodeGraphConfig, DecodeGraphRunner
    plain = ModelRunner(tiny, KVCache(tiny.config, 16, BLOCK, torch.float32, DEVICE), backend="torch")
    graphs = DecodeGraphRunner(
        ModelRunner(tiny, KVCache(tiny.config, 16, BLOCK, torch.float32, DEVICE), backend="triton"),
        DecodeGraphConfig(max_batch=4, max_model_len=64, capture=ON_GPU))
    tables = [[7, 3], [11], [2]]
    prompts = [SeqChunk(list(range(300, 317)), 0, tables[0], (16,)), SeqChunk([400, 401], 0, tables[1], (1,)),
               SeqChunk([500], 0, tables[2], (0,))]
    steps = [prompts,
             [SeqChunk([42], 17, tables[0], (0,)), SeqChunk([43], 2, tables[1], (0,)), SeqChunk([44], 1, tables[2], (0,))],
             [SeqChunk([45], 18, tables[0], (0,))]]
    for chunks in steps:
        got, expected = graphs.execute(chunks), plain.execute(chunks)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert graphs.padded_steps == 2
    torch.testing.assert_close(graphs.kv_cache.data, plain.kv_cache.data, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(ON_GPU, reason="the story is a capture that fails; on the GPU it succeeds")
def test_a_capture_that_fails_leaves_every_step_on_the_plain_runner(tiny, caplog):
    """Here the capture fails (no CUDA): the engine still serves, every step unpadded as with
    --cuda-graphs off, and says why once."""
    from services.engine.model.decode_graphs import DecodeGraphConfig, DecodeGraphRunner
    plain = ModelRunner(tiny, KVCache(tiny.config, 16, BLOCK, torch.float32, DEVICE), backend="torch")
    with caplog.at_level("WARNING", logger="services.engine.model.decode_graphs"):
        graphs = DecodeGraphRunner(
            ModelRunner(tiny, KVCache(tiny.config, 16, BLOCK, torch.float32, DEVICE), backend="triton"),
            DecodeGraphConfig(max_batch=2, max_model_len=32, capture=True))
    assert graphs.capture_error and "capture failed, every step runs eagerly" in caplog.text
    chunks = [SeqChunk([300, 301], 0, [3], (1,))]
    torch.testing.assert_close(graphs.execute(chunks), plain.execute(chunks), atol=2e-4, rtol=1e-4)
    chunks = [SeqChunk([42], 2, [3], (0,))]
    torch.testing.assert_close(graphs.execute(chunks), plain.execute(chunks), atol=2e-4, rtol=1e-4)
    assert graphs.padded_steps == 0
