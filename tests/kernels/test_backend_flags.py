"""--attention-backend reaches the engine config from `kvfleet serve` and `kvfleet up`, and the
engine core's wire format carries it."""
from __future__ import annotations

import argparse

import msgspec
import pytest

from services.engine.config import EngineConfig


def test_serve_flag_sets_the_engine_config():
    from services.worker.serve import add_worker_args, engine_config_for
    p = argparse.ArgumentParser()
    add_worker_args(p)
    assert engine_config_for(p.parse_args(["mixed"])).attention_backend == "auto"
    assert engine_config_for(p.parse_args(["decode", "--attention-backend", "triton"])).attention_backend == "triton"
    with pytest.raises(SystemExit):
        p.parse_args(["mixed", "--attention-backend", "flash"])


def test_up_accepts_the_flag():
    from services.cli.up import add_up_args
    p = argparse.ArgumentParser()
    add_up_args(p)
    assert p.parse_args([]).attention_backend is None          # workers keep their default (auto)
    assert p.parse_args(["--attention-backend", "torch"]).attention_backend == "torch"


def test_engine_core_wire_format_keeps_the_choice():
    cfg = EngineConfig(attention_backend="triton")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=EngineConfig).attention_backend == "triton"
