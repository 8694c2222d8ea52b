"""DS-Analyzer's what-if model: predicted stalls and throughput of an input pipeline for another
cache size, number of loader workers or storage bandwidth, from the rates one
:class:`~paratrain.runtime.data.analyzer.StallReport` measured (Mohan et al., VLDB'21, sec. 3.2).

Per epoch of ``D`` items of average size ``s`` bytes, a fraction ``x`` of them cached (MinIO: the
hit rate is exactly ``x``, :mod:`.minio`):

- compute ``C = D / compute_rate``;
- prep ``P = D / (per_worker_rate * min(workers, cores))`` -- preparation scales with workers until
  the cores run out (``per_worker_rate``: the measured capacity over the workers that produced it);
- fetch ``F = (1 - x) * D * s / storage_bandwidth + x * D * s / memory_bandwidth`` (the paper's
  cache formula);
- epoch ``max(C, P) + F``: prep overlaps compute, and fetch adds on top as the differential
  measurement defines it (fetch stall = cold run - cached run), so at the measured configuration
  the model gives back the measured epoch. Prep stall ``max(P - C, 0)``, fetch stall ``F``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from paratrain.errors import ConfigError
from paratrain.fileio import atomic_write_png

from .analyzer import StallReport

__all__ = ["Measured", "Prediction", "measured_from", "predict", "sweep_cache", "plot_cache_sweep"]


@dataclass(frozen=True)
class Measured:
    dataset_items: int
    avg_item_bytes: float
    compute_rate_items_s: float
    prep_capacity_items_s: float
    workers: int
    cores: int
    storage_bytes_s: float | None  # None: no fetch stall was measured (storage fast enough)
    memory_bytes_s: float

    @property
    def per_worker_prep_items_s(self) -> float:
        return self.prep_capacity_items_s / min(max(self.workers, 1), self.cores)


def measured_from(report: StallReport) -> Measured:
    return Measured(report.dataset_items, report.avg_item_bytes, report.compute_rate_items_s,
                    report.prep_capacity_items_s, report.workers, report.cores, report.storage_bytes_s,
                    report.memory_bytes_s)


@dataclass(frozen=True)
class Prediction:
    cache_fraction: float
    workers: int
    storage_bytes_s: float | None
    epoch_time_s: float
    throughput_items_s: float
    prep_stall_s: float
    fetch_stall_s: float
    prep_stall_fraction: float
    fetch_stall_fraction: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict(m: Measured, *, cache_fraction: float, workers: int | None = None,
            storage_bytes_s: float | None = None) -> Prediction:
    """Stalls and throughput of one epoch with ``cache_fraction`` of the dataset cached, ``workers``
    loader workers (default: as measured) and storage of ``storage_bytes_s`` (default: as measured)."""
    if not 0.0 <= cache_fraction <= 1.0:
        raise ConfigError("--cache-fraction", f"must be in [0, 1], got {cache_fraction}", "use e.g. 0.5")
    w = m.workers if workers is None else workers
    if w < 0:
        raise ConfigError("--workers", f"must be at least 0, got {w}", "use e.g. --workers 4")
    bw = m.storage_bytes_s if storage_bytes_s is None else storage_bytes_s
    if bw is not None and not bw > 0:
        raise ConfigError("--bandwidth-mbs", f"must be positive, got {bw / 1e6:g} MB/s", "use e.g. 200")
    d, s = m.dataset_items, m.avg_item_bytes
    compute = d / m.compute_rate_items_s
    prep = d / (m.per_worker_prep_items_s * min(max(w, 1), m.cores))
    miss = (1 - cache_fraction) * d * s / bw if bw is not None else 0.0
    fetch = miss + cache_fraction * d * s / m.memory_bytes_s
    epoch = max(compute, prep) + fetch
    prep_stall = max(prep - compute, 0.0)
    return Prediction(cache_fraction, w, bw, epoch, d / epoch, prep_stall, fetch, prep_stall / epoch, fetch / epoch)


def sweep_cache(m: Measured, fractions: Sequence[float], **kw: Any) -> list[Prediction]:
    return [predict(m, cache_fraction=x, **kw) for x in fractions]


def plot_cache_sweep(path: str | os.PathLike[str], m: Measured, *, workers: Sequence[int] | None = None,
                     storage_bytes_s: float | None = None, points: int = 21,
                     measured: tuple[float, float] | None = None) -> None:
    """PNG of predicted throughput vs cache size (share of the dataset), one line per worker
    count; ``measured``: a (cache fraction, items/s) point to mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fractions = [i / (points - 1) for i in range(points)]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for w in workers or [m.workers]:
        preds = sweep_cache(m, fractions, workers=w, storage_bytes_s=storage_bytes_s)
        ax.plot([100 * p.cache_fraction for p in preds], [p.throughput_items_s for p in preds],
                marker="o", markersize=3, label=f"{w} worker{'s' if w != 1 else ''}")
    ax.axhline(m.compute_rate_items_s, color="grey", linestyle="--", linewidth=1, label="compute rate (no stall)")
    if measured is not None:
        ax.plot([100 * measured[0]], [measured[1]], "k*", markersize=10, label="measured")
    bw = storage_bytes_s if storage_bytes_s is not None else m.storage_bytes_s
    ax.set_xlabel("cache size (% of the dataset, MinIO)")
    ax.set_ylabel("items / s")
    ax.set_title(f"what-if: {m.dataset_items} items of {m.avg_item_bytes / 1e3:.1f} kB, storage "
                 + (f"{bw / 1e6:.1f} MB/s" if bw is not None else "not a bottleneck"), fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write_png(path, fig, "--plot", dpi=100)
    plt.close(fig)
