"""Tensor parallelism (services/engine/model/tensor_parallel.py, services/engine/tp_ranks.py).

The story: a model sharded for rank r of N keeps exactly its slice of every weight and its own KV
heads, and a rank loading from disk reads exactly that slice and nothing more; a model whose heads do not divide is refused before any process starts; and
`kvfleet generate --tensor-parallel 2` (rank 0 here, one real follower process, gloo on 127.0.0.1)
produces the same greedy tokens and log-probs as the unsharded engine, within 1e-4 in fp32, and
leaves no process behind.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from services.cli.cli import build_parser
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.model import KVCache, load_model
from services.engine.model.config import ModelConfig
from services.engine.model.tensor_parallel import (TPGroup, check_shardable, rank_config, shard_model,
                                                   shard_ranges, vocab_shard_size)
from services.engine.sampling_params import SamplingParams
from services.engine.tp_ranks import TPRankFailed

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [100, 200, 300]]
MAX_TOKENS = 10
TOP_N = 3


def test_rank_1_of_2_keeps_its_heads_its_mlp_slice_and_its_vocab_rows(tiny_model_dir):
    full = load_model(tiny_model_dir, dtype="float32")       # 8 heads, 2 KV heads, d 32, I 512
    sharded = shard_model(load_model(tiny_model_dir, dtype="float32"), TPGroup(1, 2))
    cfg = sharded.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size) == (4, 1, 256, 4096)

    attn, ref = sharded.model.layers[0].self_attn, full.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (4, 1)
    w = ref.qkv_proj.weight                                  # rows: q 0..255, k 256..319, v 320..383
    assert torch.equal(attn.qkv_proj.weight, torch.cat([w[128:256], w[288:320], w[352:384]]))
    assert torch.equal(attn.o_proj.weight, ref.o_proj.weight[:, 128:256])

    mlp, ref_mlp = sharded.model.layers[0].mlp, full.layers[0].mlp
    gate_up = ref_mlp.gate_up_proj.weight                    # rows: gate 0..511, up 512..1023
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate_up[256:512], gate_up[768:1024]]))
    assert torch.equal(mlp.down_proj.weight, ref_mlp.down_proj.weight[:, 256:512])

    assert torch.equal(sharded.model.embed_tokens.weight, full.embed_tokens.weight[2048:])
    assert torch.equal(sharded.model.lm_head.weight, full.lm_head.weight[2048:])
    cache = KVCache(cfg, num_blocks=4, block_size=16, dtype=torch.float32)
    assert cache.data.shape == (4, 2, 4, 16, 1, 32)          # this rank's one KV head


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_loads_from_disk_exactly_its_shard_and_nothing_else(tiny_model_dir, rank):
    full = load_model(tiny_model_dir, dtype="float32")
    cut = shard_model(load_model(tiny_model_dir, dtype="float32"), TPGroup(rank, 2))
    loaded = load_model(tiny_model_dir, dtype="float32", tp=TPGroup(rank, 2))
    assert loaded.config == cut.config and loaded.config.num_kv_heads == 1
    _assert_same_parameters(loaded, cut)
    norms = sum(p.numel() for name, p in full.named_parameters() if "norm" in name)
    sharded = sum(p.numel() for name, p in loaded.named_parameters() if "norm" not in name)
    assert sharded * 2 == sum(p.numel() for p in full.parameters()) - norms   # a half, no more


def test_a_tied_uneven_vocab_shard_loads_padded_from_disk(config_b_dir):
    cut = shard_model(load_model(config_b_dir, dtype="float32"), TPGroup(2, 3))
    loaded = load_model(config_b_dir, dtype="float32", tp=TPGroup(2, 3))
    assert loaded.model.lm_head is None and loaded.model.embed_tokens.num_real == 1364
    _assert_same_parameters(loaded, cut)


def _assert_same_parameters(got: torch.nn.Module, want: torch.nn.Module) -> None:
    got_params, want_params = dict(got.named_parameters()), dict(want.named_parameters())
    assert got_params.keys() == want_params.keys()
    for name, tensor in want_params.items():
        assert torch.equal(got_params[name], tensor), name


@given(world=st.integers(1, 8), kv_per_rank=st.integers(1, 3), group=st.integers(1, 4),
       inter_per_rank=st.integers(1, 64), vocab=st.integers(1, 5000))
def test_the_ranks_ranges_tile_every_sharded_tensor_exactly_once(world, kv_per_rank, group,
                                                                  inter_per_rank, vocab):
    kv, d = world * kv_per_rank, 4
    config = ModelConfig(vocab, 64, world * inter_per_rank, 1, kv * group, kv, d, 1e-5, 1e4, None,
                         4096, False, None, (), "float32")
    full = {"model.layers.0.self_attn.q_proj.weight": kv * group * d,
            "model.layers.0.self_attn.k_proj.weight": kv * d,
            "model.layers.0.self_attn.o_proj.weight": kv * group * d,
            "model.layers.0.mlp.down_proj.weight": world * inter_per_rank,
            "model.embed_tokens.weight": vocab}
    per_rank = [shard_ranges(config, TPGroup(r, world)) for r in range(world)]
    for name, size in full.items():
        parts = [ranges[name] for ranges in per_rank]
        assert parts[0].start == 0 and parts[-1].stop == size                # covers it all
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))     # no gap, no overlap
    vocab_rows = vocab_shard_size(vocab, world)
    assert all(ranges["lm_head.weight"].pad_to == vocab_rows for ranges in per_rank)


def test_an_uneven_vocab_is_padded_and_a_tied_head_reads_the_embedding_shard(config_b_dir):
    full = load_model(config_b_dir, dtype="float32")         # 6 heads, 3 KV heads, tied, V 4096
    sharded = shard_model(load_model(config_b_dir, dtype="float32"), TPGroup(2, 3))
    embed = sharded.model.embed_tokens
    assert sharded.model.lm_head is None                     # tied: llama.py reads embed.weight
    assert embed.weight.shape == (1366, 192) and (embed.start, embed.num_real) == (2732, 1364)
    assert torch.equal(embed.weight[:1364], full.embed_tokens.weight[2732:])
    assert not embed.weight[1364:].any()                     # padding rows: zero logits, sliced off


def test_heads_that_do_not_divide_are_refused_naming_them_before_any_process_starts(config_b_dir):
    cfg = load_model(config_b_dir, dtype="float32").config
    with pytest.raises(ValueError, match=r"num_kv_heads 3 not divisible by 2"):
        check_shardable(cfg, 2)
    with pytest.raises(ValueError, match=r"num_heads 6, num_kv_heads 3"):
        rank_config(cfg, 4)
    with pytest.raises(ValueError, match=r"num_kv_heads 3 not divisible by 2"):
        LLMEngine(EngineConfig(model=str(config_b_dir), tensor_parallel_size=2))
    assert not dist.is_initialized() and not _follower_children()


def test_a_follower_that_cannot_map_the_shared_kv_file_fails_the_start_naming_it(tiny_model_dir,
                                                                                 tmp_path):
    def alloc(shape, dtype):                       # rank 0's memory; the followers get `path`
        return torch.zeros(shape, dtype=dtype)
    alloc.path = str(tmp_path / "no-such-dir" / "kv")
    with pytest.raises(TPRankFailed, match=r"tensor-parallel rank 1 \(pid \d+\) exited with status 1"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", tensor_parallel_size=2),
                  kv_alloc=alloc)
    assert not dist.is_initialized() and not _follower_children()


def test_kvfleet_generate_refuses_an_indivisible_size_in_one_line(config_b_dir, capsys):
    # prompt ids: this checkpoint has no tokenizer, and generate refuses text for it before the model
    args = build_parser().parse_args(["generate", "--model", str(config_b_dir), "--prompt-ids",
                                      "1,2,3", "--tensor-parallel", "2"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfleet generate: ") and "num_kv_heads 3 not divisible by 2" in err
    assert "Traceback" not in err and not _follower_children()


def test_generate_with_tensor_parallel_2_matches_tp_1_tokens_and_logprobs(tiny_model_dir, capsys):
    ids = [",".join(map(str, p)) for p in PROMPTS]
    args = build_parser().parse_args(
        ["generate", "--model", str(tiny_model_dir), "--dtype", "float32", "--json", "--echo",
         "--logprobs", str(TOP_N), "--max-tokens", str(MAX_TOKENS), "--tensor-parallel", "2",
         *[a for i in ids for a in ("--prompt-ids", i)]])
    assert args.func(args) == 0
    tp2 = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert not dist.is_initialized() and not _follower_children()   # the follower is stopped

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32"))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOP_N,
                            prompt_logprobs=TOP_N)
    tp1 = [engine.generate([p], params)[0] for p in PROMPTS]

    assert len(tp2) == len(tp1) == 2
    for got, want in zip(tp2, tp1):
        assert got["token_ids"] == want.token_ids and len(want.token_ids) == MAX_TOKENS
        assert _close(got["logprobs"], [lp.logprob for lp in want.logprobs])
        assert _close(got["prompt_logprobs"][1:], [lp.logprob for lp in want.prompt_logprobs[1:]])
        for alts, lp in zip(got["top_logprobs"], want.logprobs):
            assert [a["token_id"] for a in alts] == [t for t, _ in lp.top]
            assert _close([a["logprob"] for a in alts], [v for _, v in lp.top])


def _close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def _follower_children() -> list[int]:
    """Live children of this process running a tensor-parallel follower."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if int(stat[1]) == os.getpid() and stat[0] not in "ZX" and b"services.engine.tp_ranks" in cmdline:
            found.append(int(entry))
    return found
