"""CoorDL's two single-machine mitigations, measured here on a generated image folder.

    .venv/bin/python bench/bench_data.py                      # both parts, defaults below
    .venv/bin/python bench/bench_data.py --items 2048 --fetch-ms 2 --jobs 3

1. **MinIO vs LRU**: a cache of ``--cache`` (share of the dataset's bytes) in front of storage
   that waits ``--fetch-ms`` per item read, ``--epochs`` epochs in a random order per epoch, one
   loader process (the LRU cache is per process, like a worker's). Prints each epoch's hit rate,
   the items read from storage and the epoch time. Target: MinIO hits 50 +- 2 % after epoch 1 at
   a 50 % cache, LRU lower.
2. **Coordinated prep**: ``--jobs`` jobs (processes) training on the same data for ``--epochs``
   epochs, each step a ``--compute-ms`` wait (an accelerator's step): independent loaders (each job
   prepares everything) against coordinated prep (each item prepared once per epoch, shared
   through /dev/shm). Prints the CPU seconds the jobs spent preparing items (measured around the
   loader, which prepares in the job's process), all their CPU seconds (with the sharing's own
   cost: writing, reading and polling for batches) and the wall time; target: coordinated prep
   CPU about one job's, i.e. about 1/jobs of the independent total.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import shutil
import tempfile
import time
from pathlib import Path

from paratrain.runtime.data.coordinated import DEFAULT_SHM, CoordinatedLoader
from paratrain.runtime.data.images import EpochSampler, ImageFolder, ThrottledReader, generate_images, make_loader
from paratrain.runtime.data.minio import CachedDataset, LRUCache, MinIOCache


def _cache_part(root: Path, args: argparse.Namespace) -> None:
    reader = ThrottledReader(args.fetch_ms / 1e3)
    ds = ImageFolder(root, image_size=args.image_size, reader=reader)
    capacity = int(args.cache * ds.total_bytes())
    print(f"MinIO vs LRU: {len(ds)} items, {ds.total_bytes() / 1e6:.2f} MB, cache {100 * args.cache:.0f}% "
          f"({capacity / 1e6:.2f} MB), storage {args.fetch_ms} ms/item, {args.epochs} epochs, random order")
    print(f"{'cache':<6} {'epoch':>5} {'hit rate':>9} {'storage reads':>14} {'epoch (s)':>10}")
    after_first = {}
    for name in ("minio", "lru"):
        cache = MinIOCache([ds.item_bytes(i) for i in range(len(ds))], capacity) if name == "minio" \
            else LRUCache(capacity)
        cached = CachedDataset(ds, cache)
        hits_total = misses_total = 0
        for epoch in range(args.epochs):
            cache.reset_counters()
            t = time.perf_counter()
            for _ in make_loader(cached, batch_size=16, workers=0,
                                 sampler=EpochSampler(len(ds), seed=1, start_epoch=epoch)):
                pass
            dt = time.perf_counter() - t
            hits, misses = cache.hits_misses()
            if epoch > 0:
                hits_total, misses_total = hits_total + hits, misses_total + misses
            print(f"{name:<6} {epoch + 1:>5} {100 * hits / (hits + misses):>8.1f}% {misses:>14} {dt:>10.2f}")
        after_first[name] = hits_total / (hits_total + misses_total)
        if isinstance(cache, MinIOCache):
            cache.close()
    print(f"hit rate after epoch 1: MinIO {100 * after_first['minio']:.1f}%, LRU {100 * after_first['lru']:.1f}% "
          f"(ratio {after_first['minio'] / max(after_first['lru'], 1e-9):.2f}x)")


def _job(root: str, store: str | None, job: int, args: argparse.Namespace, out: mp.Queue) -> None:
    ds = ImageFolder(root, image_size=args.image_size)
    prep_cpu = 0.0
    if store is None:
        it = iter(make_loader(ds, batch_size=args.batch, workers=0,
                              sampler=EpochSampler(len(ds), seed=job, epochs=args.epochs)))
        while True:
            cpu = time.process_time()
            batch = next(it, None)
            prep_cpu += time.process_time() - cpu
            if batch is None:
                break
            time.sleep(args.compute_ms / 1e3)
    else:
        loader = CoordinatedLoader(ds, store=store, job=job, jobs=args.jobs, batch_size=args.batch,
                                   epochs=args.epochs, seed=1)
        for _ in loader:
            time.sleep(args.compute_ms / 1e3)
        prep_cpu = loader.stats.prep_cpu_s
    out.put(prep_cpu)


def _jobs(root: Path, store: str | None, args: argparse.Namespace) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of all jobs, of which preparing items) of ``--jobs`` processes run together."""
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    procs = [ctx.Process(target=_job, args=(str(root), store, j, args, out)) for j in range(args.jobs)]
    for p in procs:
        p.start()
    prep = sum(out.get() for _ in procs)
    for p in procs:
        p.join()
        assert p.exitcode == 0, f"job failed ({p.exitcode})"
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, cpu, prep


def _coord_part(root: Path, args: argparse.Namespace) -> None:
    items = len(ImageFolder(root, image_size=args.image_size))
    print(f"\ncoordinated prep: {args.jobs} jobs, {items} items, {args.epochs} epochs, batch {args.batch}, "
          f"compute {args.compute_ms} ms/batch")
    wall_i, cpu_i, prep_i = _jobs(root, None, args)
    store = tempfile.mkdtemp(prefix="paratrain-coordl-", dir=DEFAULT_SHM if DEFAULT_SHM.is_dir() else None)
    try:
        wall_c, cpu_c, prep_c = _jobs(root, store, args)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    n = args.jobs * items * args.epochs
    print(f"{'loaders':<12} {'wall (s)':>9} {'prep CPU (s)':>13} {'all CPU (s)':>12} {'items/s (all jobs)':>19}")
    print(f"{'independent':<12} {wall_i:>9.2f} {prep_i:>13.2f} {cpu_i:>12.2f} {n / wall_i:>19.1f}")
    print(f"{'coordinated':<12} {wall_c:>9.2f} {prep_c:>13.2f} {cpu_c:>12.2f} {n / wall_c:>19.1f}")
    print(f"prep CPU coordinated / independent = {prep_c / prep_i:.2f} (1/jobs = {1 / args.jobs:.2f}); all CPU "
          f"{cpu_c / cpu_i:.2f} (sharing through /dev/shm costs the difference); throughput x{wall_i / wall_c:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1024)
    ap.add_argument("--source-size", type=int, default=256, help="generated JPEGs' width and height")
    ap.add_argument("--image-size", type=int, default=64, help="crop size of the augmentation")
    ap.add_argument("--cache", type=float, default=0.5, help="cache size, share of the dataset's bytes")
    ap.add_argument("--fetch-ms", type=float, default=1.0)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--compute-ms", type=float, default=5.0)
    ap.add_argument("--part", choices=("all", "cache", "coordinated"), default="all")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="paratrain-bench-data-"))
    try:
        generate_images(tmp / "imgs", args.items, args.source_size)
        if args.part in ("all", "cache"):
            _cache_part(tmp / "imgs", args)
        if args.part in ("all", "coordinated"):
            _coord_part(tmp / "imgs", args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
