"""`python -m services.prefill`: the engine in the prefill role as a gRPC worker."""
import sys

from services.cli.serve_cmd import main

sys.exit(main("prefill"))
