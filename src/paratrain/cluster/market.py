"""Cloud spot prices: price series per (cloud, region, accelerator type), the latest price each
round, a synthetic generator, and the cost of the best static choice.

"Analysis and Exploitation of Dynamic Pricing in the Public Cloud for ML Training" (Narayanan et al.)
observes that spot prices of comparable GPU instances vary over time, regions and clouds, and that
moving jobs between them is cheap. Gavel operationalizes it the way this module does: each round the
scheduler takes, per accelerator type, the lowest latest price over the clouds and regions it may
use; a change in any price triggers a re-solve of the cost policy.

Price file (CSV, one change per line, header required)::

    time_s,cloud,region,worker_type,price_per_hour
    0,aws,us-east-1,v100,0.918

``price_per_hour`` is per accelerator. A series' first price holds from time 0.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.cluster.throughputs import ThroughputTable
from paratrain.cluster.trace import Job
from paratrain.errors import ConfigError
from paratrain.fileio import check_not_special

__all__ = ["PriceSeries", "PriceBook", "read_prices", "format_prices", "synthetic_prices", "static_choice_costs",
           "dynamic_cost", "ON_DEMAND_PER_HOUR"]

# On-demand $/h per accelerator used as the synthetic generator's scale: AWS p2.xlarge (1 K80)
# $0.90, GCP P100 $1.46, AWS p3.2xlarge (1 V100) $3.06 (the price lists Gavel's cost experiments
# used, 2020); A100/H100 from AWS p4d.24xlarge $32.77/8 and p5.48xlarge $98.32/8 (2023 lists).
ON_DEMAND_PER_HOUR = {"k80": 0.90, "p100": 1.46, "v100": 3.06, "a100": 4.10, "h100": 12.29}


@dataclass
class PriceSeries:
    cloud: str
    region: str
    worker_type: str
    times_s: list[float] = field(default_factory=list)
    prices: list[float] = field(default_factory=list)

    def at(self, t: float) -> float:
        i = bisect.bisect_right(self.times_s, t) - 1
        return self.prices[max(i, 0)]

    def integral(self, t0: float, t1: float) -> float:
        """∫ price dt over [t0, t1] in $·h/h... i.e. dollars for one accelerator (times in s)."""
        total, t = 0.0, t0
        i = max(bisect.bisect_right(self.times_s, t0) - 1, 0)
        while t < t1:
            nxt = self.times_s[i + 1] if i + 1 < len(self.times_s) else math.inf
            end = min(nxt, t1)
            total += self.prices[i] * (end - t) / 3600.0
            t, i = end, i + 1
        return total


@dataclass
class PriceBook:
    series: list[PriceSeries]
    clouds: tuple[str, ...] | None = None  # None: every cloud in the book

    def usable(self) -> list[PriceSeries]:
        return [s for s in self.series if self.clouds is None or s.cloud in self.clouds]

    def latest(self, t: float, types: tuple[str, ...] | list[str]) -> dict[str, float]:
        out = {}
        for w in types:
            ps = [s.at(t) for s in self.usable() if s.worker_type == w]
            if not ps:
                raise ConfigError("--prices", f"no price for accelerator type {w!r}",
                                  "add its series to the price file (or drop the type)")
            out[w] = min(ps)
        return out


def read_prices(path: str | Path, field_name: str = "--prices") -> PriceBook:
    p = Path(path)
    check_not_special(p, field_name, "give a price CSV (see paratrain cluster generate-prices)")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(field_name, f"cannot read {str(p)!r}: {e}", "check the path") from None
    return parse_prices(text, field_name)


def parse_prices(text: str, field_name: str = "--prices") -> PriceBook:
    rows = list(csv.reader(io.StringIO(text)))
    header = ["time_s", "cloud", "region", "worker_type", "price_per_hour"]
    if not rows or [h.strip() for h in rows[0]] != header:
        raise ConfigError(field_name, "the first line is not the header " + ",".join(header), "add the header")
    series: dict[tuple[str, str, str], PriceSeries] = {}
    for lineno, row in enumerate(rows[1:], 2):
        if not row:
            continue
        if len(row) != 5:
            raise ConfigError(field_name, f"line {lineno}: {len(row)} fields instead of 5", "write " + ",".join(header))
        try:
            t, price = float(row[0]), float(row[4])
        except ValueError:
            raise ConfigError(field_name, f"line {lineno}: time or price is not a number", "fix the line") from None
        if not (math.isfinite(t) and t >= 0 and math.isfinite(price) and price > 0):
            raise ConfigError(field_name, f"line {lineno}: time must be ≥ 0 and price > 0", "fix the line")
        s = series.setdefault((row[1], row[2], row[3]), PriceSeries(row[1], row[2], row[3]))
        if s.times_s and t <= s.times_s[-1]:
            raise ConfigError(field_name, f"line {lineno}: times of a series must increase", "sort the file by time")
        s.times_s.append(t)
        s.prices.append(price)
    if not series:
        raise ConfigError(field_name, "no prices", "add at least one line")
    return PriceBook(list(series.values()))


def format_prices(book: PriceBook) -> str:
    lines = ["time_s,cloud,region,worker_type,price_per_hour"]
    for s in book.series:
        rows = zip(s.times_s, s.prices, strict=True)
        lines += [f"{t:g},{s.cloud},{s.region},{s.worker_type},{p:.4f}" for t, p in rows]
    return "\n".join(lines) + "\n"


def synthetic_prices(
    types: tuple[str, ...] | list[str],
    *,
    duration_s: float,
    seed: int = 0,
    places: tuple[tuple[str, str], ...] = (("aws", "us-east-1"), ("aws", "us-west-2"), ("gcp", "us-central1"),
                                           ("azure", "eastus")),
    mean_change_interval_s: float = 3 * 3600.0,
    step_sigma: float = 0.15,
) -> PriceBook:
    """A random spot-price history: each series starts at 25–45 % of the on-demand price and, at
    exponentially spaced changes (mean ``mean_change_interval_s``), moves by a log-normal factor
    (σ = ``step_sigma``), kept within 20–100 % of on-demand. Assumed, not fitted: the paper reports
    changes a few times a day and spot discounts of roughly 3× with differences across regions and
    clouds; the parameters reproduce that order of variability."""
    rng = random.Random(seed)
    series = []
    for cloud, region in places:
        for w in types:
            od = ON_DEMAND_PER_HOUR.get(w, 2.0)
            price = od * rng.uniform(0.25, 0.45)
            s = PriceSeries(cloud, region, w, [0.0], [round(price, 4)])
            t = 0.0
            while True:
                t += -math.log(1.0 - rng.random()) * mean_change_interval_s
                if t >= duration_s:
                    break
                price = min(max(price * math.exp(rng.gauss(0.0, step_sigma)), 0.2 * od), od)
                s.times_s.append(round(t, 1))
                s.prices.append(round(price, 4))
            series.append(s)
    return PriceBook(series)


def static_choice_costs(jobs: tuple[Job, ...] | list[Job], table: ThroughputTable, book: PriceBook
                        ) -> dict[str, float]:
    """Cost of the static alternative for each series: every job runs alone, from its arrival, on
    that one (cloud, region, type) at that series' prices until done. Series that cannot run every
    job are left out. Keys ``cloud/region/type``."""
    out = {}
    for s in book.usable():
        total = 0.0
        for job in jobs:
            thr = table.get(job.key, s.worker_type)
            if thr <= 0:
                break
            end = job.arrival_time_s + job.total_steps / thr
            total += job.scale_factor * s.integral(job.arrival_time_s, end)
        else:
            out[f"{s.cloud}/{s.region}/{s.worker_type}"] = total
    return out


def dynamic_cost(jobs: tuple[Job, ...] | list[Job], table: ThroughputTable, book: PriceBook,
                 round_s: float = 360.0) -> float:
    """Cost when every job, alone and with the cloud's capacity unbounded, moves at each round
    boundary to the (cloud, region, type) with the lowest latest price per step: the dynamic policy
    of the pricing paper, against which :func:`static_choice_costs` is the static one."""
    total = 0.0
    usable = book.usable()
    for job in jobs:
        left, t = float(job.total_steps), job.arrival_time_s
        while left > 0:
            best = None
            for s in usable:
                thr = table.get(job.key, s.worker_type)
                if thr > 0:
                    per_step = s.at(t) / thr
                    if best is None or per_step < best[0]:
                        best = (per_step, s, thr)
            if best is None:
                raise ConfigError("--prices", f"no priced accelerator type runs {job.job_type}",
                                  "add prices for a type the job has a throughput on")
            _, s, thr = best
            span = min(round_s, left / thr)
            total += job.scale_factor * s.integral(t, t + span)
            left = 0.0 if span < round_s else left - thr * span
            t += span
    return total
