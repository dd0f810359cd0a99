"""decode worker: the engine in the decode role, served over gRPC (services/worker/servicer.py).

`python -m services.decode [--port P] [--redis-url URL] [--kv-backend nixl|tcp|local]`.
"""
