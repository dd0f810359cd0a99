"""The prefill role (`PrefillRole`, handler.py): run a prompt to its first token and ship its KV;
a Role (services/worker/role.py) that the worker serves when the serve entry picks it."""
