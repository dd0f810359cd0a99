"""The mixed (co-located) role: a whole request, prefill and decode, on one worker (generate.py)."""
