"""router: admission and placement. Router.Admit answers with a plan: the workers that serve the
request (by KV capacity, queue state and prefix hits) and, disaggregated, the decode worker's
reservation (Worker.Reserve). The router is on no token path: the gateway runs the plan.

Admission by predicted TTFT (predict.py, admission.py; a request may wait in the Redis wait queue,
waiting.py), the overload stages of DESIGN.md section 6 (stages.py, decided once for the fleet by
keeper.py) and the fallback pool (pools.py). `python -m services.router --redis-url URL
[--mode disagg|colocated]`.
"""
