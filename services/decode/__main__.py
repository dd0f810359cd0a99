"""`python -m services.decode`: the engine in the decode role as a gRPC worker."""
import sys

from services.cli.serve_cmd import main

sys.exit(main("decode"))
