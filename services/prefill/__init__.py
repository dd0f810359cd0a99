"""prefill worker: the engine in the prefill role, served over gRPC (services/worker/servicer.py).

`python -m services.prefill [--port P] [--redis-url URL] [--kv-backend nixl|tcp|local]`.
"""
