"""The worker process: gRPC servicer (servicer.py) in front of an engine core in a process of its
own (engine_client.py, engine_core.py), serving the role it was started with (serve.py)."""
