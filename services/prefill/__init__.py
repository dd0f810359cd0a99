"""The prefill role: run a prompt to its first token and ship its KV (handler.py)."""
