"""CoorDL's coordinated prep (Mohan et al., VLDB'21, sec. 4.3): ``k`` jobs on one machine that
train on the same dataset (a hyper-parameter search) fetch and prepare every item once per epoch
between them, instead of once per job.

Each epoch's seeded permutation is cut into batches; batch ``i`` is prepared by job ``i mod k``
(its shard) and put into a :class:`BatchStore`, a directory in shared memory (``/dev/shm``) where
a prepared batch lives with a reference count of ``k`` until every job has read it; the last
reader deletes it. Every job reads every batch, so each job sees each item once per epoch, but
in its own order: the epoch's batches are taken a window of ``window`` batches at a time, in a
permutation of the window seeded by the job. Jobs are independent processes (launched apart,
as a search's trials are) that agree on the store directory, the seed and ``k``.

No job waits for a slower one except through memory: a job prepares window ``w`` only once its
own batches of window ``w - 2`` were read by everyone, so at most two windows are in the store.
That wait cannot deadlock: a job blocked at window ``w`` waits on readers at window ``w - 2`` or
earlier, whose batches were all prepared. A job never blocks on its own preparation either:
waiting for a peer's batch, it prepares its own next batch when allowed (one thread per job).

Store writes are inter-process messages in shared memory, not user output: plain writes renamed
into place (a reader never sees half a batch), without the fsyncs of :mod:`paratrain.fileio`.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from paratrain.errors import ConfigError

from .images import make_loader

__all__ = ["BatchStore", "CoordinatedLoader", "CoordStats", "epoch_batches", "DEFAULT_SHM"]

DEFAULT_SHM = Path("/dev/shm")
# a peer's batch is polled for, the wait doubling from POLL_S to MAX_POLL_S (short next to preparing a batch)
POLL_S, MAX_POLL_S = 0.0005, 0.008


class BatchStore:
    """Prepared batches by name in a directory, each with a reference count (one lock file serializes
    the counts' updates)."""

    def __init__(self, root: str | os.PathLike[str], readers: int) -> None:
        self.root, self.readers = Path(root), readers
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.root / "refcounts.lock"

    def _path(self, name: str) -> Path:
        return self.root / f"{name}.batch"

    def put(self, name: str, obj: Any) -> None:
        # tensors travel as numpy arrays: their pickle is one copy of the buffer (torch.save's zip costs more)
        blob = pickle.dumps(tree_map(lambda t: t.numpy() if isinstance(t, torch.Tensor) else t, obj), protocol=5)
        for path, data in ((self.root / f"{name}.ref", str(self.readers).encode()), (self._path(name), blob)):
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)  # the count first: a batch that can be seen can be counted down

    def exists(self, name: str) -> bool:
        return self._path(name).exists()

    def take(self, name: str) -> Any:
        """Read batch ``name`` (it must exist) and count this reader off; the last one deletes it."""
        with open(self._path(name), "rb") as fh:
            obj = tree_map(lambda a: torch.from_numpy(a) if hasattr(a, "__array_interface__") else a,
                           pickle.load(fh))  # noqa: S301 (our own jobs' batches)
        with open(self._lock_path, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            ref = self.root / f"{name}.ref"
            left = int(ref.read_bytes()) - 1
            if left == 0:
                self._path(name).unlink()
                ref.unlink()
            else:
                ref.write_bytes(str(left).encode())
        return obj


def epoch_batches(items: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """The epoch's batches: its seeded permutation in consecutive slices (the last partial one dropped)."""
    order = torch.randperm(items, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    return [order[i * batch_size:(i + 1) * batch_size] for i in range(items // batch_size)]


@dataclass
class CoordStats:
    prepared_items: int = 0  # by this job, for everyone
    prepared_batches: int = 0
    wait_s: float = 0.0  # time spent waiting for a peer's batch
    prep_cpu_s: float = 0.0  # this process's CPU time preparing its batches (all of it with workers=0)


class CoordinatedLoader:
    """Job ``job`` of ``jobs``: iterate ``(keys, batch)`` over ``epochs`` epochs of ``dataset``.

    ``keys``: the batch's ``(epoch, index)`` pairs; ``batch``: the DataLoader's collated items.
    ``store``: the search's shared directory (a fresh one per search; default under /dev/shm).
    ``workers``: this job's DataLoader workers preparing its shard. ``window``: batches per window
    (default ``4 * jobs``); a job's order is a permutation of each window.
    """

    def __init__(self, dataset: Any, *, store: str | os.PathLike[str], job: int, jobs: int, batch_size: int,
                 epochs: int, seed: int = 0, workers: int = 0, window: int | None = None,
                 timeout_s: float = 300.0) -> None:
        if not 0 <= job < jobs:
            raise ConfigError("--job", f"job {job} is not in 0..{jobs - 1}", "number the jobs 0..k-1")
        if batch_size > len(dataset):
            raise ConfigError("--batch-size", f"{batch_size} is more than the {len(dataset)} items",
                              "use a smaller batch")
        self.dataset, self.job, self.jobs, self.batch_size = dataset, job, jobs, batch_size
        self.epochs, self.seed, self.workers = epochs, seed, workers
        self.window = window or 4 * jobs
        self.timeout_s = timeout_s
        self.store = BatchStore(store, jobs)
        self.stats = CoordStats()
        self.per_epoch = len(dataset) // batch_size

    def _name(self, epoch: int, batch: int) -> str:
        return f"e{epoch:05d}_b{batch:07d}"

    def _mine(self) -> Iterator[tuple[int, int, list[tuple[int, int]]]]:
        """This job's share of the batches, in preparation order: (epoch, batch id, keys)."""
        for e in range(self.epochs):
            for b, idx in enumerate(epoch_batches(len(self.dataset), self.batch_size, self.seed, e)):
                if b % self.jobs == self.job:
                    yield e, b, [(e, i) for i in idx]

    def _order(self, epoch: int) -> list[int]:
        """The order this job reads the epoch's batches in: each window permuted by the job's seed."""
        out: list[int] = []
        for start in range(0, self.per_epoch, self.window):
            ids = list(range(start, min(start + self.window, self.per_epoch)))
            gen = torch.Generator().manual_seed(((self.seed * 1_000_003 + epoch) * 7919 + start) * 131 + self.job)
            out.extend(ids[i] for i in torch.randperm(len(ids), generator=gen).tolist())
        return out

    def _window(self, epoch: int, batch: int) -> int:
        return epoch * ((self.per_epoch + self.window - 1) // self.window) + batch // self.window

    def __iter__(self) -> Iterator[tuple[list[tuple[int, int]], Any]]:
        plan = list(self._mine())
        loader = make_loader(self.dataset, batch_size=self.batch_size, workers=self.workers,
                             batch_sampler=[keys for _, _, keys in plan])
        prepared = iter(loader)
        done: list[tuple[int, str]] = []  # (window, name) of my batches put so far
        nxt = 0

        def may_prepare() -> bool:
            if nxt >= len(plan):
                return False
            w = self._window(plan[nxt][0], plan[nxt][1])
            return all(wd > w - 2 or not self.store.exists(n) for wd, n in done)

        def prepare_one() -> None:
            nonlocal nxt
            e, b, keys = plan[nxt]
            cpu = time.process_time()
            batch = next(prepared)
            self.stats.prep_cpu_s += time.process_time() - cpu
            self.store.put(self._name(e, b), {"keys": torch.tensor(keys), "batch": batch})
            done.append((self._window(e, b), self._name(e, b)))
            self.stats.prepared_items += len(keys)
            self.stats.prepared_batches += 1
            nxt += 1

        for e in range(self.epochs):
            for b in self._order(e):
                name = self._name(e, b)
                waited, poll = time.perf_counter(), POLL_S
                while not self.store.exists(name):
                    if may_prepare():
                        prepare_one()
                        continue
                    if time.perf_counter() - waited > self.timeout_s:
                        raise TimeoutError(f"job {self.job}: batch {name} did not appear in {self.timeout_s:.0f} s "
                                           f"(is every one of the {self.jobs} jobs running?)")
                    time.sleep(poll)
                    poll = min(2 * poll, MAX_POLL_S)
                    done[:] = [(w, n) for w, n in done if self.store.exists(n)]
                self.stats.wait_s += time.perf_counter() - waited
                obj = self.store.take(name)
                keys = [(int(k[0]), int(k[1])) for k in obj["keys"]]
                yield keys, obj["batch"]
                done[:] = [(w, n) for w, n in done if self.store.exists(n)]
                while may_prepare() and len(done) < 2 * self.window:  # keep ahead while memory allows
                    prepare_one()
