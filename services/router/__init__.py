"""router: admission and placement. Router.Admit answers with a plan: the workers that serve the
request (by KV capacity, queue state and prefix hits) and, disaggregated, the decode worker's
reservation (Worker.Reserve). The router is on no token path: the gateway runs the plan.

`python -m services.router --redis-url URL [--mode disagg|colocated]`. Admission by predicted TTFT
and the overload stages of DESIGN.md section 6 are not built yet.
"""
