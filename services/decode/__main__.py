"""`python -m services.decode`: the engine in the decode role as a gRPC worker
(`--role mixed` is not accepted here; use `kvfleet serve mixed` for a co-located worker)."""
import sys

from services.worker.serve import main

sys.exit(main("decode"))
