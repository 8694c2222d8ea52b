"""DS-Analyzer's differential measurement of data stalls (Mohan et al., "Analyzing and Mitigating
Data Stalls in DNN Training", VLDB'21, sec. 3.1).

The same ``batches`` mini-batches of ``b`` items are timed four times, after ``warmup`` batches
that fill the loader's pipeline (worker start-up is not a stall of the steady state):

1. **synthetic**: one real batch, already in memory, fed to the compute step again and again:
   ``T1`` = compute alone. Compute (the paper's *ingestion*) rate = ``N·b / T1``.
2. **cold**: the real pipeline with storage cold (page cache dropped where this process may,
   else a fresh copy of the files written past the page cache): ``T2`` = fetch + prep + compute.
3. **cached**: the real pipeline with every item's bytes already in memory: ``T3`` = prep + compute.
   Prep rate = ``N·b / T3``.
4. **prep only**: as 3 without the compute step: the loader's preparation capacity, which the
   what-if model scales with the number of workers.

Prep stall = ``max(T3 - T1, 0)``; fetch stall = ``max(T2 - T3, 0)``; fetch rate = ``N·b / (T2 - T3)``.
Stall fractions are shares of the cold run's time, the time a real epoch takes; per-epoch seconds
scale the timed items to the dataset's size.

A dataset with the two stages apart (:class:`~paratrain.runtime.data.images.StagedDataset`) gets
each run as described. Any other DataLoader (a user's ``module:function``) is timed as it is: the
cold run after dropping the page cache or evicting the ``files`` given (``posix_fadvise``), the
cached run as a second pass that finds them in the page cache.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paratrain.errors import ConfigError

from .images import EpochSampler, make_loader
from .stats import RunStats, cpu_cores, difference, read_counters

__all__ = ["Compute", "RunTiming", "StallReport", "InMemory", "analyze_dataset", "analyze_loader",
           "sleep_compute", "model_compute", "cold_storage", "memory_bandwidth_bytes_s", "COLD_METHODS"]

Compute = Callable[[Any], None]
COLD_METHODS = ("drop_caches", "fresh_copy", "fadvise", "uncached")
PRELOAD_THREADS = 8  # concurrent reads filling the cached run's memory


def sleep_compute(seconds: float) -> Compute:
    """A stand-in for an accelerator's step of known duration (the host waits, as for a GPU)."""

    def step(batch: Any) -> None:
        time.sleep(seconds)

    return step


def model_compute(model: torch.nn.Module, lr: float = 0.01) -> Compute:
    """One SGD step of ``model`` on an ``(images, labels)`` batch: the training step the input
    pipeline feeds (on this machine's CPU, it competes with the loader's workers for cores)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step(batch: Any) -> None:
        images, labels = batch
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        opt.step()

    return step


class InMemory:
    """A staged dataset whose items' bytes (those of ``indices``) are held in this process's memory:
    forked loader workers share them, and ``fetch`` never touches storage."""

    def __init__(self, dataset: Any, indices: Iterable[int]) -> None:
        self.dataset = dataset
        self.epoch = dataset.epoch
        wanted = sorted(set(indices))
        # storage answers several reads at once (and a throttled reader waits): read in parallel
        with ThreadPoolExecutor(max_workers=PRELOAD_THREADS) as pool:
            self.blobs = dict(zip(wanted, pool.map(dataset.fetch, wanted), strict=True))

    def __len__(self) -> int:
        return len(self.dataset)

    def fetch(self, index: int) -> bytes:
        blob = self.blobs.get(index)
        return blob if blob is not None else self.dataset.fetch(index)

    def prep(self, raw: bytes, key: Any) -> Any:
        return self.dataset.prep(raw, key)

    def item_bytes(self, index: int) -> int:
        return int(self.dataset.item_bytes(index))

    def __getitem__(self, key: Any) -> Any:
        index = key[1] if isinstance(key, tuple) else key
        return self.prep(self.fetch(index), key)


def _evict(paths: Sequence[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped: write them first (a fresh copy has some)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as fh:
            fh.write("3\n")
        return True
    except OSError:  # not root, or a container's read-only /proc/sys
        return False


class cold_storage:  # noqa: N801 (a context manager used like a function)
    """``with cold_storage(dataset) as (cold, method):`` -- ``cold`` reads its files from storage,
    not the page cache. ``method``: ``drop_caches`` (root: the whole page cache dropped),
    ``fresh_copy`` (the files copied into a temporary directory beside the data, synced and evicted
    with ``posix_fadvise(DONTNEED)``; removed on exit) or ``uncached`` (no files: nothing to drop)."""

    def __init__(self, dataset: Any, *, allow_drop: bool = True) -> None:
        self.dataset, self.allow_drop = dataset, allow_drop
        self.tmp: Path | None = None
        self.inner: cold_storage | None = None

    def __enter__(self) -> tuple[Any, str]:
        ds = self.dataset
        files: list[Path] | None = getattr(ds, "files", None)
        root: Path | None = getattr(ds, "root", None)
        inner = getattr(ds, "dataset", None)
        if not files and inner is not None:  # a wrapper (a cache): make what it wraps cold
            self.inner = cold_storage(inner, allow_drop=self.allow_drop)
            cold_inner, method = self.inner.__enter__()
            wrapper = copy.copy(ds)
            wrapper.dataset = cold_inner
            return wrapper, method
        if not files or root is None:
            return ds, "uncached"
        if self.allow_drop and _drop_caches():
            return ds, "drop_caches"
        parent = root.parent if os.access(root.parent, os.W_OK) else None
        self.tmp = Path(tempfile.mkdtemp(prefix=".paratrain-cold-", dir=parent))
        moved = []
        for f in files:
            dst = self.tmp / f.relative_to(root)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
            moved.append(dst)
        _evict(moved)
        cold = copy.copy(ds)
        cold.root, cold.files = self.tmp, moved
        return cold, "fresh_copy"

    def __exit__(self, *exc: object) -> None:
        if self.inner is not None:
            self.inner.__exit__(*exc)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def memory_bandwidth_bytes_s(size_bytes: int = 64 * 2**20, repeats: int = 3) -> float:
    """Bytes per second of copying a buffer in memory (the cost of a cache hit in the what-if)."""
    src = np.ones(size_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return size_bytes / best


@dataclass(frozen=True)
class RunTiming:
    """One of the four runs: the timed batches' seconds and the host counters around the whole run."""

    name: str
    seconds: float
    cpu_s: float
    cpu_util: float
    host_cpu_util: float | None
    disk_read_bytes: int | None


@dataclass(frozen=True)
class StallReport:
    batch_size: int
    batches: int
    warmup: int
    workers: int
    cores: int
    dataset_items: int
    avg_item_bytes: float
    cold_method: str
    cached_method: str
    compute_rate_items_s: float
    prep_rate_items_s: float
    prep_capacity_items_s: float
    fetch_rate_items_s: float | None  # None: no fetch stall measured
    throughput_items_s: float  # the cold run's: what training on this pipeline gets
    prep_stall_fraction: float
    fetch_stall_fraction: float
    epoch_time_s: float
    prep_stall_s: float  # per epoch
    fetch_stall_s: float  # per epoch
    cpu_util: float  # cold run: share of the machine's cores used by this process and its workers
    disk_read_bytes_s: float | None  # cold run, from /proc/diskstats (whole host)
    storage_bytes_s: float | None  # avg item bytes * fetch rate: the storage speed the pipeline saw
    memory_bytes_s: float
    runs: list[RunTiming] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(doc: dict[str, Any]) -> StallReport:
        runs = [RunTiming(**r) for r in doc.get("runs", [])]
        names = {f for f in StallReport.__dataclass_fields__}
        return StallReport(**{**{k: v for k, v in doc.items() if k in names}, "runs": runs})


def _timed(batches_of: Callable[[], Iterator[Any]], compute: Compute | None, warmup: int, batches: int,
           name: str) -> RunTiming:
    start = read_counters()
    it = batches_of()
    t0 = time.perf_counter()
    for k in range(warmup + batches):
        try:
            batch = next(it)
        except StopIteration:
            raise ConfigError("--batches", f"the loader ended after {k} batches, {warmup + batches} are timed",
                              "use fewer --batches/--warmup or a larger dataset") from None
        if compute is not None:
            compute(batch)
        if k == warmup - 1:
            t0 = time.perf_counter()
    seconds = time.perf_counter() - t0
    del it  # joins the loader's workers, so their CPU time is counted
    stats: RunStats = difference(start, read_counters())
    return RunTiming(name, seconds, stats.cpu_s, stats.cpu_util, stats.host_cpu_util, stats.disk_read_bytes)


def _report(runs: dict[str, RunTiming], *, batch_size: int, batches: int, warmup: int, workers: int,
            dataset_items: int, avg_item_bytes: float, cold_method: str, cached_method: str) -> StallReport:
    items = batches * batch_size
    t1, t2, t3 = runs["synthetic"].seconds, runs["cold"].seconds, runs["cached"].seconds
    prep_stall, fetch_stall = max(t3 - t1, 0.0), max(t2 - t3, 0.0)
    fetch_rate = items / fetch_stall if fetch_stall > 0 else None
    scale = dataset_items / items
    disk = runs["cold"].disk_read_bytes
    return StallReport(
        batch_size=batch_size, batches=batches, warmup=warmup, workers=workers, cores=cpu_cores(),
        dataset_items=dataset_items, avg_item_bytes=avg_item_bytes, cold_method=cold_method,
        cached_method=cached_method, compute_rate_items_s=items / t1, prep_rate_items_s=items / t3,
        prep_capacity_items_s=items / runs["prep_only"].seconds, fetch_rate_items_s=fetch_rate,
        throughput_items_s=items / t2, prep_stall_fraction=prep_stall / t2, fetch_stall_fraction=fetch_stall / t2,
        epoch_time_s=t2 * scale, prep_stall_s=prep_stall * scale, fetch_stall_s=fetch_stall * scale,
        cpu_util=runs["cold"].cpu_util, disk_read_bytes_s=None if disk is None else disk / t2,
        storage_bytes_s=None if fetch_rate is None else fetch_rate * avg_item_bytes,
        memory_bytes_s=memory_bandwidth_bytes_s(), runs=list(runs.values()))


def _check_counts(dataset_items: int, batch_size: int, batches: int, warmup: int) -> None:
    if batch_size < 1 or batches < 1 or warmup < 0:
        raise ConfigError("--batches", f"batch size {batch_size}, batches {batches}, warm-up {warmup}",
                          "use a positive batch size and --batches, and --warmup >= 0")
    need = (warmup + batches) * batch_size
    if need > dataset_items:
        raise ConfigError("--batches", f"(warmup {warmup} + batches {batches}) x batch {batch_size} = {need} items, "
                          f"the dataset has {dataset_items}: later items would come from a warm cache",
                          "use fewer --batches/--warmup, a smaller --batch-size or a larger dataset")


def analyze_dataset(dataset: Any, compute: Compute, *, batch_size: int, batches: int, workers: int,
                    warmup: int | None = None, seed: int = 0, allow_drop: bool = True) -> StallReport:
    """The differential measurement of a staged dataset (``fetch``/``prep``) read by a DataLoader of
    ``workers`` workers in a seeded random order. ``warmup`` defaults to ``max(workers, 1)`` batches.
    The timed items are all distinct (one epoch), so the cold run never hits a warm cache."""
    warmup = max(workers, 1) if warmup is None else warmup
    _check_counts(len(dataset), batch_size, batches, warmup)
    sampler = EpochSampler(len(dataset), seed=seed)
    used = sampler.order(0)[: (warmup + batches) * batch_size]

    def loader_over(ds: Any) -> Callable[[], Iterator[Any]]:
        return lambda: iter(make_loader(ds, batch_size=batch_size, workers=workers, sampler=sampler))

    runs: dict[str, RunTiming] = {}
    first = next(iter(make_loader(dataset, batch_size=batch_size, workers=0, sampler=sampler)))
    runs["synthetic"] = _timed(lambda: iter([first] * (warmup + batches)), compute, warmup, batches, "synthetic")
    with cold_storage(dataset, allow_drop=allow_drop) as (cold, method):
        runs["cold"] = _timed(loader_over(cold), compute, warmup, batches, "cold")
    cached = InMemory(dataset, used)
    runs["cached"] = _timed(loader_over(cached), compute, warmup, batches, "cached")
    runs["prep_only"] = _timed(loader_over(cached), None, warmup, batches, "prep_only")
    avg = sum(dataset.item_bytes(i) for i in used) / len(used)
    return _report(runs, batch_size=batch_size, batches=batches, warmup=warmup, workers=workers,
                   dataset_items=len(dataset), avg_item_bytes=avg, cold_method=method, cached_method="in_memory")


def _files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def analyze_loader(make: Callable[[], torch.utils.data.DataLoader], compute: Compute, *, batches: int,
                   warmup: int = 1, data: str | os.PathLike[str] | None = None,
                   allow_drop: bool = True) -> StallReport:
    """The differential measurement of any DataLoader that ``make()`` builds afresh each run. A
    staged dataset inside it is measured as :func:`analyze_dataset` does; otherwise the files under
    ``data`` are evicted from the page cache for the cold run and the cached run is a second pass."""
    loader = make()
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise ConfigError("--pipeline", f"returned {type(loader).__name__}, not a torch.utils.data.DataLoader",
                          "make the function return a DataLoader")
    ds, bs = loader.dataset, loader.batch_size or 1
    if all(hasattr(ds, a) for a in ("fetch", "prep", "item_bytes", "epoch")):
        return analyze_dataset(ds, compute, batch_size=bs, batches=batches, workers=loader.num_workers,
                               warmup=warmup, allow_drop=allow_drop)
    n_items = len(ds) if hasattr(ds, "__len__") else (warmup + batches) * bs
    _check_counts(n_items, bs, batches, warmup)
    files = _files_under(Path(data)) if data is not None else []
    runs: dict[str, RunTiming] = {}
    first = next(iter(make()))
    runs["synthetic"] = _timed(lambda: iter([first] * (warmup + batches)), compute, warmup, batches, "synthetic")
    if allow_drop and _drop_caches():
        method = "drop_caches"
    elif files:
        _evict(files)
        method = "fadvise"
    else:
        method = "uncached"
    runs["cold"] = _timed(lambda: iter(make()), compute, warmup, batches, "cold")
    runs["cached"] = _timed(lambda: iter(make()), compute, warmup, batches, "cached")
    runs["prep_only"] = _timed(lambda: iter(make()), None, warmup, batches, "prep_only")
    size = sum(f.stat().st_size for f in files) / len(files) if files else 0.0
    return _report(runs, batch_size=bs, batches=batches, warmup=warmup, workers=loader.num_workers,
                   dataset_items=n_items, avg_item_bytes=size, cold_method=method, cached_method="page_cache")
