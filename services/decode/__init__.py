"""The decode role: reservations, KV import and the decode stream (reservations.py)."""
