"""router: placement by KV capacity and queue state, Reserve -> Prefill -> Decode orchestration.

`python -m services.router --redis-url URL [--mode disagg|colocated]`. Admission by predicted TTFT
and the overload stages of DESIGN.md section 6 are not built yet.
"""
