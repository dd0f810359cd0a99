"""Freed activations kept in the heap, so a CPU engine's next step does not fault them back in.

A prefill step's activations are tensors of megabytes ([2048, 3072] float32 is 24 MiB). glibc's
malloc serves an allocation over its mmap threshold (128 KiB, raised on the fly up to 32 MiB)
with a fresh mmap and returns it with munmap when freed, and it trims the heap's free top back
to the OS above its trim threshold. Either way the next tensor of that size is new pages: a
minor page fault per 4 KiB on first touch, in the kernel, on every step. Measured on this
2-core box: RMSNorm with its residual over 2,048 rows of SmolLM2 (bfloat16) took ~1,970 minor
faults and 5.5 ms a call, and 77 faults and 1.3 ms with the thresholds raised
(docs/benchmarks.md, "The engine next to vLLM, round 3"). vLLM's CPU build has users preload
tcmalloc for the same reason.

keep_freed_memory() raises both thresholds (mallopt M_MMAP_THRESHOLD and M_TRIM_THRESHOLD) for
the process. The engine calls it once its model, packed weights and KV cache exist, so only
what steps allocate is kept; the cost is that the process keeps its largest step's
activations resident. A no-op where the C library has no mallopt (not glibc).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1   # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
# tried in order: recent glibc takes any value, older ones at most 32 MiB on 64-bit
MMAP_THRESHOLDS = (1 << 30, 32 << 20)
TRIM_THRESHOLD = 1 << 30    # keep up to 1 GiB of free heap top


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False where there is no mallopt
    (or it refused)."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    mmap = next((t for t in MMAP_THRESHOLDS if mallopt(M_MMAP_THRESHOLD, t)), None)
    ok = mmap is not None and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.info("malloc keeps freed activations (mmap threshold %s): %s", mmap, ok)
    return ok
