"""A CPU engine keeps freed activations in the heap (services/engine/model/cpu_malloc.py): the
next step's tensor of the same size reuses pages already mapped instead of faulting in new ones.

mallopt changes the whole process, so each story runs in a python of its own."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

# Two "steps" of RMSNorm with its residual over 2,048 rows (SmolLM2, bfloat16: the float32
# temporaries are 4.5 MiB each), then eight more, each one's minor page faults counted. Kept, the
# fewest of the eight is read: a loaded machine's reclaim (kdamond runs on this box) can take back
# a kept page and fault it in again during any one step (seen: 2 of 3 steps at once). By default,
# the most: glibc's dynamic mmap threshold rises after a freed mapping, so some later steps reuse
# part of the heap (seen: 576, 576, 1,696 pages), but a step still maps a temporary afresh.
STEPS = """
import json, resource, sys, torch
from services.engine.model.cpu_malloc import keep_freed_memory
from services.engine.model.layers import RMSNorm
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
norm = RMSNorm(576, 1e-5)
norm.weight = torch.nn.Parameter(torch.ones(576, dtype=torch.bfloat16), requires_grad=False)
x = torch.ones(2048, 576, dtype=torch.bfloat16)
step = lambda: norm(x, x)
step(); step()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "fewest": min(faults), "most": max(faults), "each": faults}))
"""
PAGES = 2048 * 576 * 4 // 4096   # pages of one float32 temporary: 1,152


def later_steps(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


glibc = pytest.mark.skipif(sys.platform != "linux", reason="mallopt is glibc's")


@glibc
def test_a_step_after_the_first_reuses_its_activation_pages():
    kept = later_steps("keep")
    assert kept["kept"] is True
    assert kept["fewest"] < PAGES // 10, kept


@glibc
def test_without_it_every_step_faults_its_activation_in_again():
    """The default this replaces: every later step maps its temporaries afresh."""
    default = later_steps("default")
    assert default["most"] >= PAGES, default
