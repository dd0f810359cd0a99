"""Load an EngineConfig from YAML (or JSON), strictly: unknown keys are errors that name the
known ones. Layout (every key optional; omitted ones keep the dataclass defaults):

    model: tiny              # or a local HF checkpoint dir
    dtype: auto
    block_size: 16
    kv_cache_mib: 256
    logprobs_mode: raw_logprobs   # or processed_logprobs (vLLM's --logprobs-mode)
    scheduler:
      token_budget: 512
      chunk_size: 256
      admission: reserve     # reserve | predict
      classes:               # replaces the defaults when given; each entry is a TrafficClass
        - {name: interactive, priority: 2, ttft_target_s: 1.0, itl_target_s: 0.1, ...}
      tenants:
        - {name: acme, weight: 2.0, max_active_seqs: 64, max_reserved_blocks: 20000}
      default_tenant: acme
"""
from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import yaml

from services.engine.config import (EngineConfig, SchedulerConfig, SimConfig, Tenant, TrafficClass,
                                    WorkerRole, role_scheduler)


def _build(cls, data: dict[str, Any], where: str, base=None):
    """cls(**data), or `base` with data's keys replaced; unknown keys are errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return cls(**data) if base is None else replace(base, **data)


def scheduler_config_from_dict(data: dict[str, Any],
                               base: SchedulerConfig | None = None) -> SchedulerConfig:
    data = dict(data)
    if "classes" in data:
        data["classes"] = tuple(_build(TrafficClass, c, f"scheduler.classes[{i}]")
                                for i, c in enumerate(data["classes"]))
    if "tenants" in data:
        data["tenants"] = tuple(_build(Tenant, {**t, "classes": tuple(t["classes"])}
                                       if "classes" in t else t, f"scheduler.tenants[{i}]")
                                for i, t in enumerate(data["tenants"]))
    return _build(SchedulerConfig, data, "scheduler", base)


def engine_config_from_dict(data: dict[str, Any], role: WorkerRole | None = None) -> EngineConfig:
    """`role`: the scheduler knobs the file does not set take that role's defaults
    (config.role_scheduler), its role included."""
    data = dict(data or {})
    if role is not None:
        data["scheduler"] = scheduler_config_from_dict(data.get("scheduler") or {},
                                                       role_scheduler(role))
    elif "scheduler" in data:
        data["scheduler"] = scheduler_config_from_dict(data["scheduler"] or {})
    if data.get("sim") is not None:          # the simulated engine core (docs/engine.md)
        data["sim"] = _build(SimConfig, data["sim"], "sim")
    return _build(EngineConfig, data, "engine config")


def load_engine_config(path: str | Path, role: WorkerRole | None = None) -> EngineConfig:
    with open(path, encoding="utf-8") as f:
        return engine_config_from_dict(yaml.safe_load(f), role)
