"""Length distributions for prompts and outputs (token counts), sampled with a caller's RNG.

  fixed      {value}
  uniform    {min, max}                     integers, both ends included
  lognormal  {median, sigma, min?, max?}    exp(N(ln median, sigma)), rounded, clipped to [min, max]
  trace      {file, column, min?, max?}     drawn from a CSV column (e.g. the Azure trace's lengths)

Every sample is an int >= 1. Clipping moves mass onto the bounds, so a lognormal's mean is the
analytic median * exp(sigma^2 / 2) only when the bounds lie far out in its tails.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np


class SpecError(ValueError):
    """A workload spec that cannot be used; the message says which field and why."""


@dataclass(frozen=True)
class LengthDist:
    kind: str                       # fixed | uniform | lognormal | trace
    value: int = 0                  # fixed
    median: float = 0.0             # lognormal
    sigma: float = 0.0              # lognormal
    lo: int = 1                     # clip bounds (uniform: its range)
    hi: int = 1 << 20
    file: str = ""                  # trace
    column: str = ""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n lengths, int64, each in [lo, hi] (fixed: exactly `value`)."""
        if self.kind == "fixed":
            return np.full(n, self.value, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(self.lo, self.hi + 1, size=n, dtype=np.int64)
        if self.kind == "lognormal":
            raw = rng.lognormal(math.log(self.median), self.sigma, size=n)
        else:
            column = trace_column(self.file, self.column)
            raw = column[rng.integers(0, len(column), size=n)]
        return np.clip(np.rint(raw), self.lo, self.hi).astype(np.int64)


def parse_length(d: object, where: str, base_dir: Path) -> LengthDist:
    if isinstance(d, int) and not isinstance(d, bool):
        d = {"dist": "fixed", "value": d}
    if not isinstance(d, dict) or "dist" not in d:
        raise SpecError(f"{where}: expected an int or a mapping with `dist` "
                        f"(fixed | uniform | lognormal | trace), got {d!r}")
    d = dict(d)
    kind = d.pop("dist")
    allowed = {"fixed": {"value"}, "uniform": {"min", "max"},
               "lognormal": {"median", "sigma", "min", "max"},
               "trace": {"file", "column", "min", "max"}}
    if kind not in allowed:
        raise SpecError(f"{where}.dist: unknown distribution {kind!r}; one of {sorted(allowed)}")
    unknown = set(d) - allowed[kind]
    if unknown:
        raise SpecError(f"{where}: unknown field(s) {sorted(unknown)} for dist {kind}; "
                        f"allowed: {sorted(allowed[kind])}")
    lo, hi = _int(d.get("min", 1), f"{where}.min"), _int(d.get("max", 1 << 20), f"{where}.max")
    if not 1 <= lo <= hi:
        raise SpecError(f"{where}: need 1 <= min <= max, got min={lo} max={hi}")
    if kind == "fixed":
        return LengthDist("fixed", value=_int(_need(d, "value", where), f"{where}.value", 1))
    if kind == "uniform":
        _need(d, "min", where), _need(d, "max", where)
        return LengthDist("uniform", lo=lo, hi=hi)
    if kind == "lognormal":
        median = float(_need(d, "median", where))
        sigma = float(_need(d, "sigma", where))
        if median <= 0 or sigma < 0:
            raise SpecError(f"{where}: need median > 0 and sigma >= 0, got {median}, {sigma}")
        return LengthDist("lognormal", median=median, sigma=sigma, lo=lo, hi=hi)
    file = str(resolve_path(_need(d, "file", where), base_dir))
    column = str(_need(d, "column", where))
    trace_column(file, column)      # fail now, with the file's columns, not mid-run
    return LengthDist("trace", file=file, column=column, lo=lo, hi=hi)


def resolve_path(name: str, base_dir: Path) -> Path:
    """A spec's file path: absolute, or relative to the spec file's folder."""
    p = Path(name)
    return p if p.is_absolute() else (base_dir / p).resolve()


@lru_cache(maxsize=16)
def read_trace(file: str) -> dict[str, list[str]]:
    """A CSV file as columns of strings."""
    path = Path(file)
    if not path.is_file():
        raise SpecError(f"trace file {file} does not exist")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SpecError(f"trace file {file} has no rows")
    return {k: [r[k] for r in rows] for k in rows[0]}


@lru_cache(maxsize=16)
def trace_column(file: str, column: str) -> np.ndarray:
    cols = read_trace(file)
    if column not in cols:
        raise SpecError(f"trace file {file} has no column {column!r}; columns: {sorted(cols)}")
    try:
        return np.asarray([float(x) for x in cols[column]], dtype=np.float64)
    except ValueError as e:
        raise SpecError(f"trace file {file}, column {column}: not numeric ({e})") from None


def _need(d: dict, key: str, where: str):
    if key not in d:
        raise SpecError(f"{where}: missing `{key}`")
    return d[key]


def _int(v: object, where: str, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise SpecError(f"{where}: expected an integer >= {lo}, got {v!r}")
    return v
