"""How many torch intra-op (OpenMP) threads a CPU engine runs: vLLM's rule, one source.

vLLM 0.32's CPU worker (vllm/utils/ompmultiprocessing.py, VLLM_CPU_OMP_THREADS_BIND=auto) gives
its compute threads one logical CPU per physical core it may run on and reserves one core for
its scheduler / front-end process (reserve = local world size, 1 without parallelism), unless
that would leave none. On this project's 2-core box that is one compute thread, the other core
left to the front end. Two OpenMP threads on a box whose other core is busy spend most of their
CPU waiting for each other at every parallel region (docs/benchmarks.md, the engine next to
vLLM), so the engine follows the same rule.

vLLM also pins its threads to those cores (OMP_PLACES / KMP_AFFINITY); the engine does not: the
fleet's processes and, here, other users share the cores, and a pinned thread cannot move off a
busy one.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

RESERVED_CORES = 1          # vLLM's reserve for its front end (one per local rank)
SYSFS_CPU = Path("/sys/devices/system/cpu")


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on (its affinity mask; every CPU where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def physical_cores(cpus: Iterable[int], sysfs: Path = SYSFS_CPU) -> int:
    """How many physical cores the logical CPUs `cpus` are (SMT siblings count once). A CPU whose
    topology sysfs does not show counts as its own core."""
    cores: set[tuple[str, str] | int] = set()
    for cpu in cpus:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(cpu)
    return len(cores)


def auto_threads(cores: int) -> int:
    """vLLM's count for `cores` physical cores: all but the reserved one, and all of them when
    that would leave none (a 1-core host runs one thread)."""
    if cores <= RESERVED_CORES:
        return max(1, cores)
    return cores - RESERVED_CORES


def engine_threads(configured: int) -> int:
    """EngineConfig.torch_threads resolved: N > 0 is N; 0 is vLLM's rule on this process's cores."""
    if configured < 0:
        raise ValueError(f"torch_threads must be >= 0 (0: vLLM's rule), got {configured}")
    return configured or auto_threads(physical_cores(allowed_cpus()))


def set_engine_threads(configured: int) -> int:
    """Set torch's intra-op threads for this process from EngineConfig.torch_threads; the count set."""
    import torch  # noqa: PLC0415 - the simulated engine and the CLI's help never import torch

    n = engine_threads(configured)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
