"""Arrival processes: when a tenant's requests arrive, as seconds from the run's start.

  poisson  {rate_rps}                                   homogeneous Poisson
  onoff    {on_rps, off_rps?, on_s, off_s}              bursty: Poisson at on_rps for on_s, then
                                                        off_rps (default 0) for off_s, repeating
  mmpp     {rates_rps: [...], mean_dwell_s: [...]}      Markov-modulated Poisson: states visited in
                                                        a cycle, each for an exponential dwell
  ramp     {start_rps, end_rps, steps?}                 offered load rising linearly over the run
                                                        (steps: N equal stairs instead)
  trace    {file, time_column?, every?, offset?,        replay of a CSV trace's timestamps (relative
            prompt_column?, output_column?}             to its first row); `every`/`offset` split a
                                                        trace between tenants (rows offset, offset +
                                                        every, ...); the length columns, when named,
                                                        give each arrival its prompt/output lengths

`rate_scale` multiplies every rate (and speeds a trace up by the same factor) while keeping the
process's shape: on/off periods and dwell times stay as written, a trace is compressed in time.
Rate-based processes are piecewise constant; each piece draws N ~ Poisson(rate * length) arrivals
placed uniformly in it, which is exactly a Poisson process of that rate.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from loadtests.distributions import SpecError, read_trace, resolve_path, trace_column

RAMP_PIECE_S = 0.1          # a linear ramp is drawn as 0.1 s pieces of constant rate


@dataclass(frozen=True)
class Arrivals:
    """Arrival times (sorted, seconds) and, for a trace with length columns, each one's lengths."""
    times: np.ndarray
    prompt_tokens: np.ndarray | None = None
    output_tokens: np.ndarray | None = None


@dataclass(frozen=True)
class ArrivalProcess:
    process: str
    params: dict                     # validated, per the table above

    def generate(self, rng: np.random.Generator, duration_s: float, rate_scale: float = 1.0) -> Arrivals:
        if self.process == "trace":
            return self._trace(duration_s, rate_scale)
        pieces = self._pieces(rng, duration_s)
        times = [t0 + (t1 - t0) * np.sort(rng.random(rng.poisson(rate * rate_scale * (t1 - t0))))
                 for t0, t1, rate in pieces if rate > 0]
        return Arrivals(np.concatenate(times) if times else np.zeros(0))

    def _pieces(self, rng: np.random.Generator, duration_s: float) -> list[tuple[float, float, float]]:
        """(start, end, rate) pieces covering [0, duration_s)."""
        p = self.params
        if self.process == "poisson":
            return [(0.0, duration_s, p["rate_rps"])]
        if self.process == "onoff":
            return _cycle([(p["on_s"], p["on_rps"]), (p["off_s"], p.get("off_rps", 0.0))], duration_s)
        if self.process == "mmpp":
            return _mmpp(rng, p["rates_rps"], p["mean_dwell_s"], duration_s)
        a, b = p["start_rps"], p["end_rps"]
        steps = p.get("steps") or max(1, int(np.ceil(duration_s / RAMP_PIECE_S)))
        edges = np.linspace(0.0, duration_s, steps + 1)
        # a staircase takes its stair's starting rate from start to end inclusive; a fine linear
        # ramp takes each piece's midpoint rate (exact in expectation)
        rates = (np.linspace(a, b, steps) if p.get("steps")
                 else a + (b - a) * (edges[:-1] + edges[1:]) / (2 * duration_s))
        return list(zip(edges[:-1], edges[1:], rates))

    def _trace(self, duration_s: float, rate_scale: float) -> Arrivals:
        p = self.params
        stamps = _timestamps(read_trace(p["file"])[p.get("time_column", "TIMESTAMP")], p["file"])
        rows = np.arange(p.get("offset", 0), len(stamps), p.get("every", 1))
        times = (stamps[rows] - stamps[0]) / rate_scale
        keep = rows[times < duration_s]
        times = times[times < duration_s]
        lengths = {k: trace_column(p["file"], p[k])[keep].astype(np.int64) if k in p else None
                   for k in ("prompt_column", "output_column")}
        return Arrivals(times, lengths["prompt_column"], lengths["output_column"])


def parse_arrival(d: object, where: str, base_dir: Path) -> ArrivalProcess:
    if not isinstance(d, dict) or "process" not in d:
        raise SpecError(f"{where}: expected a mapping with `process` (poisson | onoff | mmpp | ramp | trace)")
    d = dict(d)
    kind = d.pop("process")
    need = {"poisson": {"rate_rps"}, "onoff": {"on_rps", "on_s", "off_s"},
            "mmpp": {"rates_rps", "mean_dwell_s"}, "ramp": {"start_rps", "end_rps"}, "trace": {"file"}}
    optional = {"onoff": {"off_rps"}, "ramp": {"steps"},
                "trace": {"time_column", "every", "offset", "prompt_column", "output_column"}}
    if kind not in need:
        raise SpecError(f"{where}.process: unknown process {kind!r}; one of {sorted(need)}")
    missing, unknown = need[kind] - set(d), set(d) - need[kind] - optional.get(kind, set())
    if missing or unknown:
        raise SpecError(f"{where}: process {kind} needs {sorted(need[kind])}"
                        f"{' and allows ' + str(sorted(optional[kind])) if kind in optional else ''}; "
                        f"missing {sorted(missing)}, unknown {sorted(unknown)}")
    for k in ("rate_rps", "on_rps", "off_rps", "start_rps", "end_rps"):
        if k in d and not (_number(d[k]) and d[k] >= 0):
            raise SpecError(f"{where}.{k}: expected a rate >= 0, got {d[k]!r}")
    for k in ("on_s", "off_s"):
        if k in d and not (_number(d[k]) and d[k] > 0):
            raise SpecError(f"{where}.{k}: expected seconds > 0, got {d[k]!r}")
    if kind == "mmpp":
        rates, dwell = d["rates_rps"], d["mean_dwell_s"]
        if (not isinstance(rates, list) or not isinstance(dwell, list) or len(rates) != len(dwell)
                or len(rates) < 2 or not all(_number(r) and r >= 0 for r in rates)
                or not all(_number(s) and s > 0 for s in dwell)):
            raise SpecError(f"{where}: mmpp needs equal-length lists (2+ states) of rates_rps >= 0 "
                            f"and mean_dwell_s > 0, got {rates!r} and {dwell!r}")
    if kind == "trace":
        d["file"] = str(resolve_path(d["file"], base_dir))
        cols = read_trace(d["file"])
        for k in ("time_column", "prompt_column", "output_column"):
            if d.get(k, "TIMESTAMP" if k == "time_column" else None) not in (None, *cols):
                raise SpecError(f"{where}.{k}: {d[k]!r} is not a column of {d['file']}; columns: {sorted(cols)}")
        if "TIMESTAMP" not in cols and "time_column" not in d:
            raise SpecError(f"{where}: {d['file']} has no TIMESTAMP column; name one with time_column")
        every, offset = d.get("every", 1), d.get("offset", 0)
        if not (isinstance(every, int) and isinstance(offset, int) and 0 <= offset < every):
            raise SpecError(f"{where}: need integers 0 <= offset < every, got offset={offset!r} every={every!r}")
    return ArrivalProcess(kind, d)


def _cycle(phases: list[tuple[float, float]], duration_s: float) -> list[tuple[float, float, float]]:
    pieces, t, i = [], 0.0, 0
    while t < duration_s:
        length, rate = phases[i % len(phases)]
        pieces.append((t, min(duration_s, t + length), rate))
        t, i = t + length, i + 1
    return pieces


def _mmpp(rng: np.random.Generator, rates: list[float], dwell: list[float],
          duration_s: float) -> list[tuple[float, float, float]]:
    pieces, t, state = [], 0.0, 0
    while t < duration_s:
        length = rng.exponential(dwell[state])
        pieces.append((t, min(duration_s, t + length), rates[state]))
        t, state = t + length, (state + 1) % len(rates)
    return pieces


def _timestamps(column: list[str], file: str) -> np.ndarray:
    """Seconds from a column of numbers or ISO-like datetimes (the Azure trace has 7 fractional
    digits, more than datetime parses: they are cut to 6)."""
    try:
        return np.asarray([float(x) for x in column])
    except ValueError:
        pass
    try:
        return np.asarray([_parse_datetime(x) for x in column])
    except ValueError as e:
        raise SpecError(f"trace {file}: timestamps are neither numbers nor datetimes ({e})") from None


def _parse_datetime(s: str) -> float:
    s = s.strip()
    if "." in s:
        head, frac = s.split(".", 1)
        s = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(s).timestamp()


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
