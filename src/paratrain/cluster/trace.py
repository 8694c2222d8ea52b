"""Job traces in Gavel's format: read, write, and generate (Poisson arrivals of the published job mix).

One job per line, ten tab-separated fields: job type, command, working directory, num-steps
argument, needs data dir (0/1), total steps, scale factor (GPUs), priority weight, SLO (-1 = none)
and arrival time in seconds. Lines are kept in file order; arrival times must not decrease (Gavel's
simulator asserts the same).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from paratrain.cluster.throughputs import ThroughputTable, resolve_data_path
from paratrain.errors import ConfigError

__all__ = ["Job", "read_trace", "parse_trace", "format_trace", "generate_trace"]

_FIELDS = 10


@dataclass(frozen=True)
class Job:
    """One job of a trace. ``slo`` is the completion-time target as a multiple of the job's isolated
    duration (Gavel's convention), None without one."""

    job_type: str
    total_steps: int
    scale_factor: int = 1
    arrival_time_s: float = 0.0
    priority_weight: float = 1.0
    slo: float | None = None
    command: str = ""
    working_directory: str = ""
    num_steps_arg: str = "--num_steps"
    needs_data_dir: bool = True
    entity: str | None = None  # owner for hierarchical policies (not a field of Gavel's traces)

    @property
    def key(self) -> tuple[str, int]:
        return self.job_type, self.scale_factor

    def to_line(self) -> str:
        slo = -1.0 if self.slo is None else self.slo
        return "\t".join([self.job_type, self.command, self.working_directory, self.num_steps_arg,
                          str(int(self.needs_data_dir)), str(self.total_steps), str(self.scale_factor),
                          f"{self.priority_weight:g}", f"{slo:f}", f"{self.arrival_time_s:f}"])


def _bad(field: str, lineno: int, problem: str) -> ConfigError:
    return ConfigError(field, f"line {lineno}: {problem}",
                       "each line needs 10 tab-separated fields: type, command, directory, steps arg, "
                       "needs data dir, total steps, GPUs, priority weight, SLO, arrival time")


def parse_trace(text: str, field: str = "--jobs") -> tuple[Job, ...]:
    jobs = []
    last_arrival = -math.inf
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != _FIELDS:
            raise _bad(field, lineno, f"{len(parts)} tab-separated fields instead of {_FIELDS}")
        jtype, command, wdir, steps_arg, needs, total, sf, weight, slo, arrival = parts
        try:
            total_i, sf_i, needs_i = int(total), int(sf), int(needs)
            weight_f, slo_f, arrival_f = float(weight), float(slo), float(arrival)
        except ValueError:
            raise _bad(field, lineno, "a number field does not parse (steps, GPUs, needs data dir: "
                                      "integers; weight, SLO, arrival: numbers)") from None
        if not jtype.strip():
            raise _bad(field, lineno, "empty job type")
        if total_i < 1 or sf_i < 1:
            raise _bad(field, lineno, f"total steps ({total_i}) and GPUs ({sf_i}) must be at least 1")
        if not (math.isfinite(weight_f) and weight_f > 0):
            raise _bad(field, lineno, f"priority weight must be a positive number, got {weight}")
        if not math.isfinite(arrival_f) or arrival_f < 0:
            raise _bad(field, lineno, f"arrival time must be a number ≥ 0, got {arrival}")
        if not math.isfinite(slo_f) or (slo_f <= 0 and slo_f != -1):
            raise _bad(field, lineno, f"SLO must be positive or -1 (none), got {slo}")
        if arrival_f < last_arrival:
            raise _bad(field, lineno, f"arrival time {arrival_f:g} s is before the previous line's "
                                      f"{last_arrival:g} s (sort the trace by arrival)")
        last_arrival = arrival_f
        jobs.append(Job(job_type=jtype, total_steps=total_i, scale_factor=sf_i, arrival_time_s=arrival_f,
                        priority_weight=weight_f, slo=None if slo_f == -1 else slo_f, command=command,
                        working_directory=wdir, num_steps_arg=steps_arg, needs_data_dir=bool(needs_i)))
    if not jobs:
        raise ConfigError(field, "the trace has no jobs", "give a file with one job per line")
    return tuple(jobs)


def read_trace(path: str | Path, field: str = "--jobs") -> tuple[Job, ...]:
    """Read a Gavel trace (``gavel:max_min_fairness.trace`` for the shipped one)."""
    p = resolve_data_path(path, field)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(field, f"cannot read {str(p)!r}: {e}", "check the file") from None
    return parse_trace(text, field)


def format_trace(jobs: tuple[Job, ...] | list[Job]) -> str:
    return "".join(j.to_line() + "\n" for j in jobs)


# Gavel's synthetic job mix (scheduler/utils.py generate_job): the job type uniform over the table,
# the GPU count 1 (70 %), 2 (10 %), 4 (15 %) or 8 (5 %) when multi-GPU jobs are on, the duration on
# one V100 drawn log-uniformly from 10^1.5–10^3 minutes (80 %) or 10^3–10^4 minutes (20 %), and a
# priority weight of 5 for 20 % of jobs when priorities are on. A job type without measurements at
# the drawn GPU count falls back to 1 GPU.
_MULTI_GPU = ((0.70, 1), (0.80, 2), (0.95, 4), (1.0, 8))
# A million jobs: far past any published trace (Philly: ~100,000), still seconds to write.
MAX_GENERATED_JOBS = 1_000_000
# The slowest arrival rate (jobs per hour): one job per 1,000 hours (six weeks) on average. A trace
# models a shared cluster's queue over hours to months; slower arrivals leave the cluster idle
# between jobs, and at 1e-300 the arrival times reach 1e300 s, written as 300-digit numbers. Even a
# million jobs at this rate arrive within ~4e12 s, which floats hold to the millisecond.
MIN_RATE_PER_HOUR = 1e-3


def generate_trace(
    table: ThroughputTable,
    *,
    num_jobs: int,
    rate_per_hour: float,
    seed: int = 0,
    multi_gpu: bool = False,
    multi_priority: bool = False,
    job_types: tuple[str, ...] | None = None,
    reference_type: str = "v100",
    slo_factors: tuple[float, ...] = (),
) -> tuple[Job, ...]:
    """``num_jobs`` jobs arriving as a Poisson process of ``rate_per_hour`` (exponential gaps).

    ``slo_factors``: when given, each job draws its SLO (a multiple of its isolated duration) from
    them, as Gavel does for its SLO experiments (1.2, 2, 10).
    """
    if not 1 <= num_jobs <= MAX_GENERATED_JOBS:
        raise ConfigError("--num-jobs", f"must lie in [1, {MAX_GENERATED_JOBS:,}], got {num_jobs}",
                          "pass a smaller positive count")
    if not (math.isfinite(rate_per_hour) and rate_per_hour > 0):
        raise ConfigError("--rate", f"must be a positive number of jobs per hour, got {rate_per_hour}",
                          "pass e.g. --rate 4")
    if rate_per_hour < MIN_RATE_PER_HOUR:
        raise ConfigError("--rate", f"{rate_per_hour:g} jobs per hour is below the minimum of {MIN_RATE_PER_HOUR:g} "
                          "(one job per 1,000 hours)", f"pass at least {MIN_RATE_PER_HOUR:g}, e.g. --rate 4")
    types = sorted({k[0] for k in table.isolated if k[1] == 1 and table.get(k, reference_type) > 0})
    if job_types is not None:
        unknown = [t for t in job_types if t not in types]
        if unknown:
            raise ConfigError("--job-types", f"unknown job type {unknown[0]!r} (or not measured on "
                              f"{reference_type} at 1 GPU)", f"use one of: {'; '.join(types)}")
        types = list(job_types)
    if not types:
        raise ConfigError("--throughputs", f"no job type has a {reference_type} throughput",
                          "give a throughput file with the reference accelerator")
    rng = random.Random(seed)
    jobs = []
    t = 0.0
    for i in range(num_jobs):
        if i:
            t += -math.log(1.0 - rng.random()) / (rate_per_hour / 3600.0)
        jtype = rng.choice(types)
        sf = 1
        if multi_gpu:
            r = rng.random()
            sf = next(s for p, s in _MULTI_GPU if r < p)
            if table.get((jtype, sf), reference_type) <= 0:
                sf = 1
        minutes = 10 ** rng.uniform(3, 4) if rng.random() >= 0.8 else 10 ** rng.uniform(1.5, 3)
        steps = max(1, int(minutes * 60 * table.get((jtype, sf), reference_type)))
        weight = 5.0 if multi_priority and rng.random() < 0.2 else 1.0
        slo = rng.choice(slo_factors) if slo_factors else None
        jobs.append(Job(job_type=jtype, total_steps=steps, scale_factor=sf, arrival_time_s=round(t, 3),
                        priority_weight=weight, slo=slo))
    return tuple(jobs)
