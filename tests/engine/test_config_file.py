"""One typed config for classes, tenants and budgets, loadable from YAML, strictly."""
from __future__ import annotations

import pytest

from services.engine.config_file import engine_config_from_dict, load_engine_config

YAML = """
model: tiny
block_size: 8
scheduler:
  token_budget: 256
  chunk_size: 64
  admission: predict
  tenants:
    - {name: acme, weight: 2.0, max_active_seqs: 4, classes: [interactive]}
    - {name: globex}
  default_tenant: acme
"""


def test_yaml_becomes_frozen_typed_config(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text(YAML)
    cfg = load_engine_config(path)
    assert cfg.block_size == 8 and cfg.scheduler.token_budget == 256
    assert cfg.scheduler.admission == "predict"
    acme = cfg.scheduler.tenant("acme")
    assert acme.weight == 2.0 and acme.classes == ("interactive",) and acme.max_active_seqs == 4
    assert cfg.scheduler.traffic_class("document").output_cap == 1024   # defaults kept
    with pytest.raises(Exception):
        cfg.scheduler.token_budget = 1                                  # frozen


@pytest.mark.parametrize("data, words", [
    ({"blocksize": 8}, "unknown keys ['blocksize']"),
    ({"scheduler": {"tenants": [{"name": "x", "wieght": 1}]}}, "scheduler.tenants[0]"),
    ({"scheduler": {"admission": "yolo"}}, "unknown admission policy"),
    ({"scheduler": {"token_budget": 8, "max_running": 64}}, "must be >= max_running"),
])
def test_bad_config_is_refused_with_a_message_naming_the_problem(data, words):
    with pytest.raises(ValueError, match=None) as info:
        engine_config_from_dict(data)
    assert words in str(info.value)
