"""The decode role (`DecodeRole`, reservations.py): reservations, KV import and the decode
stream; a Role (services/worker/role.py) that the worker serves when the serve entry picks it."""
