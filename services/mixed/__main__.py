"""`python -m services.mixed`: the engine in the mixed (co-located) role as a gRPC worker."""
import sys

from services.cli.serve_cmd import main

sys.exit(main("mixed"))
