"""One fleet (router + one mixed worker) and one gateway with API keys for the whole package."""
from __future__ import annotations

import pytest

from services.engine.engine import LLMEngine, engine_config
from tests.harness import running_fleet, start_gateway
from tests.gateway.gateway_helpers import write_configs


@pytest.fixture(scope="package")
def configs(tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("gateway-config"))


@pytest.fixture(scope="package")
def fleet(redis_url, tiny_model_dir, configs):
    # the real model: test_rest and test_special_tokens compare its text with the in-process
    # engine's; the package's other tests share this one fleet
    with running_fleet(redis_url, str(tiny_model_dir), "colocated", decode=0, engine="real") as f:
        f.worker("mixed-0", "mixed", str(tiny_model_dir), extra_args=("--config", configs[0]),
                 engine="real")
        assert f.serving()
        yield f


@pytest.fixture(scope="package")
def gateway(fleet, tiny_model_dir, configs):
    engine_yaml, keys_yaml = configs
    return start_gateway(fleet, str(tiny_model_dir), "gateway", "--config", engine_yaml,
                         "--api-keys", keys_yaml)


@pytest.fixture(scope="package")
def engine(tiny_model_dir):
    """The in-process engine: what the fleet's greedy output must equal."""
    return LLMEngine(engine_config(str(tiny_model_dir), kv_cache_mib=8))
