"""The decode role's KV transports read the fleet token from the environment, as a worker's do:
the kv_transfer tests' fixture gives them one."""
from tests.kv_transfer.conftest import fleet_token_env  # noqa: F401 - an autouse fixture
