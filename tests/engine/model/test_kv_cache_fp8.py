"""The fp8 KV cache (--kv-cache-dtype fp8: float8_e4m3fn with per-tensor k/v scales): its size, what
it stores, how close attention and greedy decoding stay to a float32 cache, and the engine's block
count. KV transfer of fp8 blocks is in tests/kv_transfer/test_fp8_layout.py."""
from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model import KVCache, ModelConfig, ModelRunner, TorchAttentionBackend, kv_bytes_per_token
from services.engine.model import load_model
from services.engine.model.attention import write_kv
from services.engine.model.batch import SeqChunk, prepare_inputs
from services.engine.model.kv_cache import FP8, resolve_kv_dtype
from tests.engine.model.helpers import CONFIG_A, Seq, ShuffledBlockIds, random_tokens

BLOCK = 16


def small_config() -> ModelConfig:
    return ModelConfig.from_dict({**CONFIG_A, "model_type": "llama", "num_hidden_layers": 3})


def e4m3_error_bound(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Round-to-nearest onto e4m3 after dividing by scale: half a unit in the last place, i.e. 2^-4
    of |x| for normal values, and half the subnormal step (2^-9 / 2) times scale below 2^-6 * scale."""
    return torch.maximum(x.abs() * 2.0 ** -4, torch.full_like(x, scale * 2.0 ** -10))


def test_fp8_halves_bf16_bytes_per_token_and_stores_e4m3():
    config = small_config()  # 3 layers, 2 kv heads, head_dim 32
    assert kv_bytes_per_token(config, "fp8") == 3 * 2 * 2 * 32 * 1
    assert 2 * kv_bytes_per_token(config, "fp8") == kv_bytes_per_token(config, "bfloat16")
    cache = KVCache(config, num_blocks=10, block_size=BLOCK, dtype="fp8", k_scale=0.5, v_scale=2.0)
    assert cache.data.dtype == torch.float8_e4m3fn and cache.dtype_name == "fp8"
    assert cache.bytes_per_block == BLOCK * kv_bytes_per_token(config, "bfloat16") // 2
    assert (cache.k_scale, cache.v_scale) == (0.5, 2.0)
    assert resolve_kv_dtype("auto", "bfloat16") == torch.bfloat16 and resolve_kv_dtype("fp8") == FP8
    with pytest.raises(ValueError, match="fp8 cache only"):
        KVCache(config, num_blocks=2, block_size=BLOCK, dtype="bfloat16", k_scale=0.5)
    with pytest.raises(ValueError, match="unsupported dtype .int8. for a KV cache"):
        resolve_kv_dtype("int8")


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 4.0)])
def test_write_then_read_round_trips_within_e4m3_precision(k_scale, v_scale):
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(small_config(), num_blocks=4, block_size=BLOCK, dtype="fp8", k_scale=k_scale, v_scale=v_scale)
    k_cache, v_cache = cache.layer(1)
    k = torch.randn(24, 2, 32, generator=gen) * 3
    v = torch.randn(24, 2, 32, generator=gen) * 0.02     # small values: some land in e4m3's subnormals
    k[0, 0, :3] = torch.tensor([1e4, -1e4, 448.0 * k_scale * 1.03])  # past the range: saturates, finite
    slots = torch.randperm(4 * BLOCK, generator=gen)[:24]
    write_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)

    read_k = k_cache.view(-1, 2, 32)[slots].float() * k_scale   # what attention reads
    read_v = v_cache.view(-1, 2, 32)[slots].float() * v_scale
    assert torch.equal(read_k[0, 0, :3], torch.tensor([448.0, -448.0, 448.0]) * k_scale)
    in_range = (k.abs() <= 448.0 * k_scale)
    assert ((read_k - k).abs() <= e4m3_error_bound(k, k_scale))[in_range].all()
    assert ((read_v - v).abs() <= e4m3_error_bound(v, v_scale)).all()
    assert torch.isfinite(cache.data.float()).all()

    # the block export / import of KV transfer copies fp8 bit-exact (as bytes: no float8 index_copy_ on CPU)
    exported = cache.read_blocks([3, 0, 2])
    other = KVCache(small_config(), num_blocks=6, block_size=BLOCK, dtype="fp8")
    other.write_blocks([5, 1, 4], exported)
    assert torch.equal(other.read_blocks([5, 1, 4]).view(torch.uint8), exported.view(torch.uint8))
    assert not other.read_blocks([0, 2, 3]).view(torch.uint8).any()


def attention_case(cache_dtype, k_scale: float = 1.0, v_scale: float = 1.0, seed: int = 0):
    """Two steps of TorchAttentionBackend over one layer: first chunks of 4 sequences, then a batch of
    3 decodes and one continued prefill chunk; -> the outputs of both steps, concatenated."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, d, num_blocks = 8, 2, 32, 40
    k_cache = torch.zeros(num_blocks, BLOCK, kv_heads, d, dtype=cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.randperm(num_blocks, generator=gen).view(4, 10).tolist()
    backend, outs = TorchAttentionBackend(heads), []
    for step in ([SeqChunk([1] * n, 0, tables[i], ()) for i, n in enumerate((37, 50, 20, 64))],
                 [SeqChunk([1], n, tables[i], ()) for i, n in enumerate((37, 50, 20))]
                 + [SeqChunk([1] * 30, 64, tables[3], ())]):
        batch = prepare_inputs(step, BLOCK)
        t = batch.token_ids.numel()
        q, k, v = (torch.randn(t, h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
        meta = backend.build_metadata(batch, BLOCK, torch.float32, k_scale=k_scale, v_scale=v_scale)
        outs.append(backend.forward(q, k, v, k_cache, v_cache, meta))
    return torch.cat(outs)


def test_attention_over_an_fp8_cache_stays_close_to_float32(one_thread):
    """Tolerance: every K and V element is off by at most 2^-4 relative (e4m3 keeps 3 mantissa bits),
    so an output, a convex combination of V rows, moves by about 2^-4 * max|v| at worst: ~0.2 for
    unit-normal V (|v| < 4), plus the small shift of the softmax weights from K's error. The errors are
    independent and average out over the context: measured over 4 seeds, max 0.13-0.18 (a decode row
    with little context nearly copies one V row) and mean 0.0085-0.0089, 16x a bfloat16 cache's mean.
    Asserted: max < 0.25, mean < 0.015, and bfloat16's mean under fp8's / 8 (it did quantize)."""
    reference = attention_case(torch.float32)
    fp8 = attention_case(FP8)
    bf16 = attention_case(torch.bfloat16)
    scaled = attention_case(FP8, k_scale=0.02, v_scale=0.01)  # values sit near 448: same precision
    err = {name: (out - reference).abs() for name, out in (("fp8", fp8), ("bf16", bf16), ("scaled", scaled))}
    for name in ("fp8", "scaled"):
        assert err[name].max() < 0.25 and err[name].mean() < 0.015
    assert err["bf16"].mean() < err["fp8"].mean() / 8


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    return load_model(tiny_model_dir)


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread beats two spinning on a shared 2-core box (15x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def teacher_forced_greedy(model, cache_dtype, prompts, new_tokens: int) -> tuple[float, float]:
    """Greedy decoding with a float32 cache, and beside it a runner over a cache of `cache_dtype` fed
    the reference's tokens (teacher forcing: one divergence does not hide the rest of a sequence);
    every sequence in one batch per step. -> (fraction of the reference's greedy tokens the other
    cache also ranks first, and the largest top-2 logit gap of the reference at a token where they
    differ: 0.0 if none differs)."""
    ref_runner = ModelRunner(model, KVCache(model.config, 64, BLOCK, torch.float32))
    runner = ModelRunner(model, KVCache(model.config, 64, BLOCK, cache_dtype))
    ref_seqs = [Seq(list(p), ShuffledBlockIds(64, seed=i), BLOCK) for i, p in enumerate(prompts)]
    seqs = [Seq(list(p), ShuffledBlockIds(64, seed=i), BLOCK) for i, p in enumerate(prompts)]
    ref_logits = ref_runner.execute([s.chunk(len(s.tokens), "last") for s in ref_seqs])
    logits = runner.execute([s.chunk(len(s.tokens), "last") for s in seqs])
    agree, worst_gap = 0, 0.0
    for _ in range(new_tokens):
        tokens = ref_logits.argmax(-1)
        same = logits.argmax(-1) == tokens
        agree += int(same.sum())
        top2 = ref_logits.topk(2, dim=-1).values
        worst_gap = max([worst_gap] + (top2[:, 0] - top2[:, 1])[~same].tolist())
        for ref_seq, seq, token in zip(ref_seqs, seqs, tokens.tolist()):
            ref_seq.tokens.append(token)
            seq.tokens.append(token)
        ref_logits = ref_runner.execute([s.chunk(1, "last") for s in ref_seqs])
        logits = runner.execute([s.chunk(1, "last") for s in seqs])
    return agree / (new_tokens * len(prompts)), worst_gap


def test_greedy_tokens_with_an_fp8_cache_mostly_match_float32(tiny_model, one_thread):
    """The tiny model (4 layers, GQA 8/2), 4 prompts x 24 greedy tokens. Measured: 0.98 of the tokens
    agree (a bfloat16 cache: 1.0), and every one that differs was a near-tie for float32 (top-2 logit
    gap under 0.05; the median gap is 0.7). Asserted: agreement >= 0.9, and no difference where float32
    leads by 0.25 or more; a cache read with a wrong scale or a lost write fails both."""
    prompts = [random_tokens(n, seed=40 + n) for n in (9, 23, 40, 61)]
    agreement, worst_gap = teacher_forced_greedy(tiny_model, FP8, prompts, new_tokens=24)
    assert agreement >= 0.9, agreement
    assert worst_gap < 0.25, worst_gap


def test_an_fp8_cache_gives_the_same_logits_however_the_prompt_is_chunked(tiny_model, one_thread):
    """A first chunk attends over its own K/V as read back from the cache, like every later chunk and
    decode: the same prompt in one chunk or in six (decode-sized ones among them) scores the same."""
    tokens = random_tokens(80, seed=5)

    def prompt_logprobs(chunks):
        runner = ModelRunner(tiny_model, KVCache(tiny_model.config, 16, BLOCK, FP8))
        seq = Seq(list(tokens), ShuffledBlockIds(16, seed=1), BLOCK)
        return torch.cat([runner.execute([seq.chunk(n, "all")]) for n in chunks]).log_softmax(-1)

    whole, chunked = prompt_logprobs([80]), prompt_logprobs([30, 1, 1, 1, 7, 40])
    assert (whole - chunked).abs().max() < 1e-4


def test_the_engine_gets_twice_bf16_blocks_from_the_same_mib(tiny_model_dir):
    """The block count follows the cache dtype: the pool, admission and the stats the router reads."""
    blocks = {}
    for kv_dtype in ("auto", "bfloat16", "fp8"):  # the tiny model is float32: auto is 4 bytes an element
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_mib=4, kv_cache_dtype=kv_dtype))
        stats = engine.stats()
        assert stats.kv_blocks_total == engine.pool.num_blocks == engine.kv_cache.num_blocks
        assert engine.kv_cache.num_blocks * engine.kv_cache.bytes_per_block <= 4 << 20
        blocks[kv_dtype] = stats.kv_blocks_total
    assert blocks["fp8"] == 2 * blocks["bfloat16"] == 4 * blocks["auto"]
    assert engine.kv_cache.dtype == torch.float8_e4m3fn and engine.kv_bytes_per_token * 2 == (
        kv_bytes_per_token(engine.model_config, "bfloat16"))
