"""planner: capacity model, simulator and the prefill:decode rebalance CLI (DESIGN.md section 8).

Not built yet: no issue has been filed for it.
"""
