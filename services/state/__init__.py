"""The fleet's shared state in Redis: worker registry and tenant quotas (fleet_state.py), the wait
queue, jobs, the overload stage record and the KV event stream."""
