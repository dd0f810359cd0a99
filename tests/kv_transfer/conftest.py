"""The transports of these tests (and the target processes they spawn) read the fleet token from
the environment, as a worker's do: give them one for this package."""
from __future__ import annotations

import os

import pytest

from services.protocol import fleet_token


@pytest.fixture(scope="package", autouse=True)
def fleet_token_env():
    if os.environ.get(fleet_token.ENV_TOKEN):
        yield
        return
    os.environ[fleet_token.ENV_TOKEN] = fleet_token.generate()
    try:
        yield
    finally:
        os.environ.pop(fleet_token.ENV_TOKEN, None)
