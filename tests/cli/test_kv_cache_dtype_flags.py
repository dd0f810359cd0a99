"""--kv-cache-dtype / --kv-cache-scales reach the engine from `kvfleet generate`, `kvfleet serve`
and `kvfleet up`, and survive the engine core's wire format."""
from __future__ import annotations

import argparse
import json

import msgspec
import pytest

from services.cli.cli import build_parser
from services.engine.config import EngineConfig


def test_serve_flags_set_the_engine_config():
    from services.worker.serve import add_worker_args, engine_config_for
    p = argparse.ArgumentParser()
    add_worker_args(p)
    default = engine_config_for(p.parse_args(["decode"]))
    assert (default.kv_cache_dtype, default.kv_cache_scales) == ("auto", (1.0, 1.0))
    cfg = engine_config_for(p.parse_args(["decode", "--kv-cache-dtype", "fp8", "--kv-cache-scales", "0.5,2"]))
    assert (cfg.kv_cache_dtype, cfg.kv_cache_scales) == ("fp8", (0.5, 2.0))
    with pytest.raises(SystemExit):
        p.parse_args(["mixed", "--kv-cache-dtype", "int8"])


def test_up_takes_the_flags_for_its_workers():
    from services.cli.up import add_up_args
    p = argparse.ArgumentParser()
    add_up_args(p)
    assert p.parse_args([]).kv_cache_dtype is None      # workers keep their default (auto)
    args = p.parse_args(["--kv-cache-dtype", "fp8", "--kv-cache-scales", "0.5,2"])
    assert (args.kv_cache_dtype, args.kv_cache_scales) == ("fp8", (0.5, 2.0))   # checked by up itself
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-scales", "half"])


def test_engine_core_wire_format_keeps_the_choice():
    cfg = EngineConfig(kv_cache_dtype="fp8", kv_cache_scales=(0.25, 0.5))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=EngineConfig)
    assert (back.kv_cache_dtype, tuple(back.kv_cache_scales)) == ("fp8", (0.25, 0.5))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="kv_cache_scales"):
        EngineConfig(kv_cache_scales=(1.0, 0.0))


def test_generate_runs_on_an_fp8_cache(tiny_model_dir, capsys):
    args = build_parser().parse_args(["generate", "--model", str(tiny_model_dir), "--kv-cache-dtype", "fp8",
                                      "--prompt-ids", "5,6,7,8", "--max-tokens", "4", "--json"])
    assert args.func(args) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 4


def test_the_quality_gate_builds_its_engine_with_the_kv_cache_flags(tiny_model_dir):
    from loadtests.quality.gate import add_quality_args
    from loadtests.quality.scorer import open_scorer
    p = argparse.ArgumentParser()
    add_quality_args(p)
    args = p.parse_args(["--reference", "tiny", "--candidate", str(tiny_model_dir),
                         "--candidate-kv-cache-dtype", "fp8", "--candidate-kv-cache-scales", "0.5,0.25"])
    assert (args.reference_kv_cache_dtype, args.reference_kv_cache_scales) == ("auto", (1.0, 1.0))
    scorer = open_scorer(args.candidate, kv_cache_dtype=args.candidate_kv_cache_dtype,
                         kv_cache_scales=args.candidate_kv_cache_scales)
    try:
        cache = scorer.engine.kv_cache
        assert (str(cache.dtype), cache.k_scale, cache.v_scale) == ("torch.float8_e4m3fn", 0.5, 0.25)
        assert scorer.info.kv_cache_dtype == "fp8"            # the report names it
    finally:
        scorer.close()


def test_logprobs_mode_is_vllms_flag_on_generate_serve_and_up(tiny_model_dir, capsys):
    """--logprobs-mode processed_logprobs reports the distribution sampled from (here: at
    temperature 0.5), raw_logprobs the model's: the same draws, other logprobs. (What each mode
    gives, against vLLM: tests/engine/test_sampling_params_vllm.py.)"""
    from services.cli.up import add_up_args
    from services.worker.serve import add_worker_args, engine_config_for
    serve, up = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_worker_args(serve)
    add_up_args(up)
    assert engine_config_for(serve.parse_args(["mixed"])).logprobs_mode == "raw_logprobs"
    assert engine_config_for(serve.parse_args(
        ["mixed", "--logprobs-mode", "processed_logprobs"])).logprobs_mode == "processed_logprobs"
    assert up.parse_args(["--logprobs-mode", "processed_logprobs"]).logprobs_mode == "processed_logprobs"
    with pytest.raises(SystemExit):
        serve.parse_args(["mixed", "--logprobs-mode", "raw_logits"])
    chosen = {}
    for mode in ("raw_logprobs", "processed_logprobs"):
        args = build_parser().parse_args(["generate", "--model", str(tiny_model_dir), "--prompt-ids",
                                          "5,6,7,8", "--max-tokens", "4", "--temperature", "0.5",
                                          "--seed", "1", "--logprobs", "0", "--json",
                                          "--logprobs-mode", mode])
        assert args.func(args) == 0
        chosen[mode] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    raw, processed = chosen["raw_logprobs"], chosen["processed_logprobs"]
    assert raw["token_ids"] == processed["token_ids"]          # same seed, same draws
    assert all(lp <= 0 for lp in raw["logprobs"] + processed["logprobs"])
    assert all(abs(p - r) > 1e-3 for p, r in zip(processed["logprobs"], raw["logprobs"]))
