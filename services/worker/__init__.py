"""The worker process every role shares: `build_worker(config, role)` (build.py) serves the Role
it is given (role.py; the roles are services/prefill, services/decode, services/mixed) through the
gRPC servicer (servicer.py), in front of an engine core in a process of its own (engine_client.py,
engine_core.py); serve.py runs it as a process. It imports no role package."""
