"""A quality version names everything that shapes a model's outputs: it changes with the weights,
the dtype, the KV cache dtype (and fp8's scales), the attention backend and the engine, and it is
the same in every process that serves the same thing (a restarted worker, a cold cache)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.engine.quality_version import cache_dir, quality_version, weights_digest
from services.engine.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-seed-1"), seed=1)


def test_each_thing_that_changes_outputs_changes_the_version(tiny_model_dir, other_weights):
    base = quality_version(str(tiny_model_dir))
    assert base.startswith("float32-") and len(base) == len("float32-") + 12
    changed = [quality_version(str(other_weights)),
               quality_version(str(tiny_model_dir), dtype="bfloat16"),
               quality_version(str(tiny_model_dir), kv_cache_dtype="fp8"),
               quality_version(str(tiny_model_dir), kv_cache_dtype="bfloat16"),
               quality_version(str(tiny_model_dir), kv_cache_dtype="fp8", kv_cache_scales=(0.5, 1.0)),
               quality_version(str(tiny_model_dir), attention_backend="triton"),
               quality_version(str(tiny_model_dir), engine="sim:SimConfig(step_s=0.002)")]
    assert len({base, *changed}) == len(changed) + 1


def test_what_does_not_change_outputs_keeps_the_version(tiny_model_dir):
    base = quality_version(str(tiny_model_dir))
    assert quality_version(str(tiny_model_dir), dtype="float32") == base     # auto = the checkpoint's
    assert quality_version(str(tiny_model_dir), kv_cache_dtype="float32") == base
    # scales only matter to an fp8 cache
    assert quality_version(str(tiny_model_dir), kv_cache_scales=(0.5, 0.5)) == base


def _version_in_a_new_process(model_dir, cache_home) -> str:
    code = ("import sys; from services.engine.quality_version import quality_version as q; "
            "print(q(sys.argv[1], kv_cache_dtype='fp8'))")
    out = subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True,
                         text=True, check=True, env={**os.environ, "XDG_CACHE_HOME": str(cache_home)})
    return out.stdout.strip()


def test_a_restarted_process_reports_the_same_version_with_or_without_the_cache(tiny_model_dir,
                                                                                  tmp_path):
    cold = _version_in_a_new_process(tiny_model_dir, tmp_path)     # computes, writes the cache
    assert list((tmp_path / "kvfleet" / "weight-digests").iterdir())
    warm = _version_in_a_new_process(tiny_model_dir, tmp_path)     # reads it
    assert cold == warm == quality_version(str(tiny_model_dir), kv_cache_dtype="fp8")


def test_a_stale_cache_entry_is_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = make_tiny_model(tmp_path / "m", seed=2)
    first = weights_digest(str(model))
    make_tiny_model(tmp_path / "m", seed=3)              # new weights in the same directory
    assert weights_digest(str(model)) != first
    [entry] = cache_dir().iterdir()
    assert json.loads(entry.read_text())["digest"] == weights_digest(str(model))


def test_a_directory_without_weights_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weight files"):
        quality_version(str(tmp_path))
