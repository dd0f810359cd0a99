"""Session-wide random checkpoints (config A: GQA 8/2 + llama3 RoPE, untied; config B: 6/3, tied)."""
from __future__ import annotations

import pytest

from tests.engine.model.helpers import CONFIG_A, CONFIG_B, load_reference, make_checkpoint


@pytest.fixture(scope="session")
def config_a_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("config-a"), seed=1, **CONFIG_A)


@pytest.fixture(scope="session")
def config_b_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("config-b"), seed=2, **CONFIG_B)


@pytest.fixture(scope="session")
def hf_a(config_a_dir):
    return load_reference(config_a_dir)


@pytest.fixture(scope="session")
def hf_b(config_b_dir):
    return load_reference(config_b_dir)
