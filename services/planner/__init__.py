"""planner: capacity model, fleet simulator and measured step profiles (DESIGN.md section 8; the
prefill:decode rebalance CLI, `kvfleet rebalance`, is planned).

`step_time.py`: the StepTimer interface (how long one iteration of a batch takes) shared by the
cost model, a measured profile and the simulated engine core.
"""
