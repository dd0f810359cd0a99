"""A child as a test needs it: it says READY and waits forever; with `--hang` it ignores SIGTERM
(the stand-in for a service whose stop hangs). Run as `python -m tests.cli.stubborn_child`."""
from __future__ import annotations

import signal
import sys
import threading

if __name__ == "__main__":
    if "--hang" in sys.argv[1:]:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("READY", flush=True)
    threading.Event().wait()
