"""RequestValidator.check_input: the checks of validate() that need no KV pool, which `kvfleet
generate` runs before the model's weights load. Whatever the input, it refuses exactly what
validate() refuses with the same error, except the limits of length and KV it leaves to the
engine."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine import errors
from services.engine.block_pool import BlockPool
from services.engine.config import SchedulerConfig
from services.engine.model.config import ModelConfig
from services.engine.tokenizer import Tokenizer
from services.engine.validation import RequestValidator
from tests.engine.test_sampling_validation import anything

LEFT_TO_THE_ENGINE = (errors.ContextLengthError, errors.CapacityError)


@pytest.fixture(scope="module")
def validators(tiny_model_dir):
    config = ModelConfig.from_dir(str(tiny_model_dir))
    tokenizer = Tokenizer.from_dir(str(tiny_model_dir))
    scheduler = SchedulerConfig()
    with_pool = RequestValidator(scheduler, config, tokenizer, BlockPool(8, 16), 256)
    without = RequestValidator(scheduler, config, tokenizer, None, 256)
    return with_pool, without


prompts = (st.text(max_size=40)
           | st.lists(st.integers(-2, 4200) | st.booleans(), max_size=300))
names = st.none() | st.sampled_from(["default", "batch", "interactive", "nobody"])


def outcome(call):
    try:
        return call()
    except errors.InvalidRequestError as e:
        return e


@settings(max_examples=300, deadline=None)
@given(prompt=prompts, params=anything, tenant=names, traffic_class=names)
def test_check_input_refuses_what_validate_refuses_short_of_length_and_kv(
        validators, prompt, params, tenant, traffic_class):
    with_pool, without = validators
    full = outcome(lambda: with_pool.validate(prompt, params, tenant, traffic_class))
    early = outcome(lambda: without.check_input(prompt, params, tenant, traffic_class))
    if isinstance(full, LEFT_TO_THE_ENGINE):
        assert not isinstance(early, Exception)
    elif isinstance(full, Exception):
        assert (type(early), str(early)) == (type(full), str(full))
    else:
        assert early == full
