"""The cost model's tunable constants: one frozen set, overridable from a YAML or JSON file.

| name                     | default | meaning (source)                                                 |
|--------------------------|---------|------------------------------------------------------------------|
| mem_utilization          | 0.90    | fraction of each GPU's memory the engine may take (vLLM's        |
|                          |         | --gpu-memory-utilization default)                                |
| workspace_gb_per_gpu     | 4.0     | activations, CUDA graphs, NCCL and sampler buffers per GPU, kept |
|                          |         | out of the KV cache (vLLM's profiling run reserves a few GB)     |
| mfu                      | 0.50    | achieved fraction of dense peak FLOP/s in GEMMs and attention    |
|                          |         | (calibrated: docs/capacity.md)                                   |
| mbu                      | 0.80    | achieved fraction of HBM bandwidth when reading weights and KV   |
|                          |         | (calibrated; 75-90% is what tuned decode kernels reach)          |
| nvlink_efficiency        | 0.80    | ring all-reduce bus bandwidth over NVLink's per-direction rate   |
|                          |         | (nccl-tests on H100 show ~360 of 450 GB/s)                       |
| allreduce_hop_latency_s  | 3e-6    | latency of one ring step; an all-reduce over tp ranks takes      |
|                          |         | 2(tp-1) steps (calibrated; NVLink + NCCL launch, a few us)       |
| step_overhead_s          | 4.0e-3  | fixed per-iteration cost: scheduling, input prep, sampling,      |
|                          |         | launch gaps outside CUDA graphs (calibrated)                     |
| activation_bytes         | 2       | bytes per activation element in all-reduces (bf16)              |
| network_efficiency       | 0.92    | achieved fraction of the NIC's line rate for KV transfer         |
|                          |         | (RDMA writes of large blocks; DESIGN's 233 ms for a 32K doc)     |
| max_decode_batch         | 256     | most sequences one decode iteration runs (vLLM max_num_seqs);    |
|                          |         | used by the workload's decode cost                               |
| target_utilization       | 0.70    | busy fraction a replica is planned at (workload replica counts)  |

A constants file is a mapping of some of these names to numbers, e.g. `mfu: 0.45`; other names
are refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

import yaml


@dataclass(frozen=True, slots=True)
class Constants:
    mem_utilization: float = 0.90
    workspace_gb_per_gpu: float = 4.0
    mfu: float = 0.50
    mbu: float = 0.80
    nvlink_efficiency: float = 0.80
    allreduce_hop_latency_s: float = 3e-6
    step_overhead_s: float = 4.0e-3
    activation_bytes: float = 2
    network_efficiency: float = 0.92
    max_decode_batch: int = 256
    target_utilization: float = 0.70

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"constant {f.name}: expected a number >= 0, got {value!r}")
        for name in ("mem_utilization", "mfu", "mbu", "nvlink_efficiency", "network_efficiency",
                     "target_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"constant {name}: expected a fraction in (0, 1], "
                                 f"got {getattr(self, name)!r}")
        if self.max_decode_batch < 1:
            raise ValueError(f"constant max_decode_batch: expected >= 1, got {self.max_decode_batch!r}")

    def overridden(self, values: dict) -> Constants:
        known = {f.name for f in fields(self)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown constant(s) {unknown}; known: {sorted(known)}")
        return replace(self, **values)


def load_constants(path: str | Path | None) -> Constants:
    """The defaults, with a YAML or JSON file's values on top (None: the defaults)."""
    if path is None:
        return Constants()
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"constants file {path}: {e.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"constants file {path}: not valid {path.suffix or 'YAML'} ({e})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"constants file {path}: expected a mapping of name -> number")
    return Constants().overridden(data)
