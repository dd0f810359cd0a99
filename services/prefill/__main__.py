"""`python -m services.prefill`: the engine in the prefill role as a gRPC worker."""
import sys

from services.worker.serve import main

sys.exit(main("prefill"))
