"""What crosses process boundaries: the kvfleet.v1 protobufs (pb/, from protos/), typed call
outcomes (status.py, typed_stub.py), deadlines (timeouts.py), the fleet token and the
environment variables the project reads (env.py)."""
