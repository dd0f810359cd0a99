"""planner: capacity model, simulator and the prefill:decode rebalance CLI (DESIGN.md section 8).

`step_time.py`: the StepTimer interface (how long one iteration of a batch takes) shared by the
cost model, a measured profile and the simulated engine core.
"""
