"""Workload specs (`loadtests/workloads/*.yaml`) and the seeded request list they expand to.

A spec names traffic classes (SLO targets, prompt and output length distributions) and tenants
(class, scheduler weight, optional API key, and an arrival process each); the run is the merge of
the tenants' arrivals over `duration_s` (or the first `max_requests` of them). Example:

    name: mixed
    seed: 0
    duration_s: 30
    scale: {rate: 1.0, prompt: 0.25, output: 1.0}
    classes:
      interactive:
        slo: {ttft_s: 1.0, itl_s: 0.1}
        prompt_tokens: {dist: lognormal, median: 200, sigma: 0.5, min: 16, max: 2048}
        output_tokens: {dist: lognormal, median: 64, sigma: 0.5, min: 4, max: 256}
    tenants:
      acme: {class: interactive, weight: 1, arrival: {process: poisson, rate_rps: 2}}

A tenant's `turns: N` (default 1) makes its requests multi-turn conversations: each N consecutive
requests of the tenant are one conversation, and all its turns read the corpus from the same
offset (one `prompt_seed`), so a later turn's prompt starts with the earlier turns' (as far as the
shorter reaches): the shared prefix a prefix cache, and prefix-aware placement, can use. Its
`min_kv_blocks` (guaranteed decode KV, fleet-wide) and `critical` (default 0 and false) are the
engine config's tenant fields: the simulator's router and a local fleet's config get them.

`scale` shrinks a workload to the machine: `rate` multiplies every arrival rate (a trace is sped
up), `prompt` and `output` multiply the sampled lengths (a 32K document at prompt 0.25 is 8K).
The same spec, seed and scales give the same `PlannedRequest` list, byte for byte.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import yaml

from loadtests.arrivals import ArrivalProcess, parse_arrival
from loadtests.distributions import LengthDist, SpecError, parse_length
from loadtests.records import ClassSLO

WORKLOADS_DIR = Path(__file__).parent / "workloads"


@dataclass(frozen=True)
class ClassSpec:
    slo: ClassSLO
    prompt_tokens: LengthDist
    output_tokens: LengthDist


@dataclass(frozen=True)
class TenantSpec:
    name: str
    traffic_class: str
    weight: float
    arrival: ArrivalProcess
    api_key: str | None = None
    turns: int = 1              # requests per conversation (one shared prompt prefix)
    min_kv_blocks: int = 0      # guaranteed decode KV fleet-wide (the engine config's Tenant)
    critical: bool = False      # served at every stage, from the kept headroom


@dataclass(frozen=True)
class Scale:
    rate: float = 1.0
    prompt: float = 1.0
    output: float = 1.0


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    seed: int
    duration_s: float
    max_requests: int | None
    scale: Scale
    classes: dict[str, ClassSpec]
    tenants: tuple[TenantSpec, ...]
    description: str = ""
    path: str = ""

    def with_overrides(self, *, seed: int | None = None, duration_s: float | None = None,
                       max_requests: int | None = None, rate_scale: float | None = None) -> "WorkloadSpec":
        """The command line's overrides (None keeps the spec's value)."""
        scale = self.scale if rate_scale is None else replace(self.scale, rate=_positive(rate_scale, "rate scale"))
        return replace(self, seed=self.seed if seed is None else seed,
                       duration_s=self.duration_s if duration_s is None else _positive(duration_s, "duration"),
                       max_requests=self.max_requests if max_requests is None else max_requests,
                       scale=scale)


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    at_s: float                 # arrival, seconds from the run's start
    tenant: str
    traffic_class: str
    prompt_tokens: int
    max_tokens: int
    prompt_seed: int            # picks the prompt's content (see loadtests/prompts.py)


def load_workload(name_or_path: str) -> WorkloadSpec:
    """A spec by path, or by the name of a shipped one (`mixed` = loadtests/workloads/mixed.yaml)."""
    path = Path(name_or_path)
    if not path.is_file():
        shipped = WORKLOADS_DIR / f"{name_or_path}.yaml"
        if not shipped.is_file():
            names = sorted(p.stem for p in WORKLOADS_DIR.glob("*.yaml"))
            raise SpecError(f"workload {name_or_path!r} is neither a file nor a shipped workload ({names})")
        path = shipped
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML ({e})") from None
    return parse_workload(data, base_dir=path.parent, path=str(path))


def parse_workload(d: object, base_dir: Path = Path("."), path: str = "") -> WorkloadSpec:
    _fields(d, "workload", need={"name", "classes", "tenants"},
            allow={"seed", "duration_s", "max_requests", "scale", "description"})
    classes = {}
    for cname, c in _mapping(d["classes"], "classes").items():
        where = f"classes.{cname}"
        _fields(c, where, need={"slo", "prompt_tokens", "output_tokens"})
        _fields(c["slo"], f"{where}.slo", need=set(), allow={"ttft_s", "itl_s"})
        slo = ClassSLO(cname, *(_opt_positive(c["slo"].get(k), f"{where}.slo.{k}") for k in ("ttft_s", "itl_s")))
        classes[cname] = ClassSpec(slo, parse_length(c["prompt_tokens"], f"{where}.prompt_tokens", base_dir),
                                   parse_length(c["output_tokens"], f"{where}.output_tokens", base_dir))
    tenants = []
    for tname, t in _mapping(d["tenants"], "tenants").items():
        where = f"tenants.{tname}"
        _fields(t, where, need={"class", "arrival"},
                allow={"weight", "api_key", "turns", "min_kv_blocks", "critical"})
        turns = t.get("turns", 1)
        if not isinstance(turns, int) or isinstance(turns, bool) or turns < 1:
            raise SpecError(f"{where}.turns: expected a positive integer, got {turns!r}")
        min_kv = t.get("min_kv_blocks", 0)
        if not isinstance(min_kv, int) or isinstance(min_kv, bool) or min_kv < 0:
            raise SpecError(f"{where}.min_kv_blocks: expected an integer >= 0, got {min_kv!r}")
        critical = t.get("critical", False)
        if not isinstance(critical, bool):
            raise SpecError(f"{where}.critical: expected true or false, got {critical!r}")
        if t["class"] not in classes:
            raise SpecError(f"{where}.class: {t['class']!r} is not one of the spec's classes {sorted(classes)}")
        tenants.append(TenantSpec(tname, t["class"], _positive(t.get("weight", 1.0), f"{where}.weight"),
                                  parse_arrival(t["arrival"], f"{where}.arrival", base_dir), t.get("api_key"),
                                  turns, min_kv, critical))
    scale = d.get("scale") or {}
    _fields(scale, "scale", need=set(), allow={"rate", "prompt", "output"})
    duration = _positive(d.get("duration_s", 60.0), "duration_s")
    max_requests = d.get("max_requests")
    if max_requests is not None and (not isinstance(max_requests, int) or max_requests < 1):
        raise SpecError(f"max_requests: expected a positive integer, got {max_requests!r}")
    seed = d.get("seed", 0)
    if not isinstance(seed, int):
        raise SpecError(f"seed: expected an integer, got {seed!r}")
    return WorkloadSpec(str(d["name"]), seed, duration, max_requests,
                        Scale(**{k: _positive(v, f"scale.{k}") for k, v in scale.items()}),
                        classes, tuple(tenants), str(d.get("description", "")), path)


def plan_requests(spec: WorkloadSpec) -> list[PlannedRequest]:
    """The run's requests in arrival order. Tenant i draws from its own stream of the seed, so the
    list depends only on the spec (including seed and scales), never on the machine or the clock."""
    streams = np.random.SeedSequence(spec.seed).spawn(len(spec.tenants))
    rows = []
    for tenant, stream in zip(spec.tenants, streams):
        rng = np.random.default_rng(stream)
        cls = spec.classes[tenant.traffic_class]
        arrivals = tenant.arrival.generate(rng, spec.duration_s, spec.scale.rate)
        n = len(arrivals.times)
        prompt = arrivals.prompt_tokens if arrivals.prompt_tokens is not None else cls.prompt_tokens.sample(rng, n)
        output = arrivals.output_tokens if arrivals.output_tokens is not None else cls.output_tokens.sample(rng, n)
        seeds = rng.integers(0, 2**31 - 1, size=n)
        if tenant.turns > 1:            # a conversation's turns share its first turn's seed
            seeds = seeds[np.arange(n) // tenant.turns * tenant.turns]
        rows += [(float(t), tenant.name, tenant.traffic_class, _scaled(p, spec.scale.prompt),
                  _scaled(o, spec.scale.output), int(s))
                 for t, p, o, s in zip(arrivals.times, prompt, output, seeds)]
    rows.sort(key=lambda r: (r[0], r[1]))
    if spec.max_requests is not None:
        rows = rows[:spec.max_requests]
    return [PlannedRequest(i, *r) for i, r in enumerate(rows)]


def slo_table(spec: WorkloadSpec) -> dict[str, ClassSLO]:
    return {name: c.slo for name, c in spec.classes.items()}


def _scaled(n: int, factor: float) -> int:
    return max(1, int(round(int(n) * factor)))


def _mapping(v: object, where: str) -> dict:
    if not isinstance(v, dict) or not v:
        raise SpecError(f"{where}: expected a non-empty mapping of name -> settings")
    return v


def _fields(d: object, where: str, need: set[str], allow: set[str] = frozenset()) -> None:
    if not isinstance(d, dict):
        raise SpecError(f"{where}: expected a mapping, got {type(d).__name__}")
    missing, unknown = need - set(d), set(d) - need - allow
    if missing:
        raise SpecError(f"{where}: missing {sorted(missing)}")
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(need | allow)}")


def _positive(v: object, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise SpecError(f"{where}: expected a number > 0, got {v!r}")
    return float(v)


def _opt_positive(v: object, where: str) -> float | None:
    return None if v is None else _positive(v, where)
