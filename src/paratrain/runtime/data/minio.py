"""CoorDL's MinIO cache (Mohan et al., VLDB'21, sec. 4.1) and the LRU cache it replaces.

With a random order every epoch, an LRU cache (the OS page cache) smaller than the dataset
thrashes: an item is usually evicted just before its next use. MinIO caches a *fixed* set of items,
filled as they are first read (epoch 1) and never evicted, so from the second epoch on the hit rate
is exactly the cached share of the dataset, and storage serves only the rest.

:class:`MinIOCache` keeps the bytes in POSIX shared memory laid out before anything is read: the
cached set is a seeded permutation's prefix that fits the capacity (as CoorDL picks it per shard),
every item of it has its own slot, so the DataLoader's forked workers fill and read the one cache
without a lock (an item's slot is written before its "present" flag is set). Hit and miss counters
live in shared memory too, one pair per worker. :class:`LRUCache` is the per-process baseline.
:class:`CachedDataset` puts either in front of a staged dataset's ``fetch``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from multiprocessing.shared_memory import SharedMemory
from typing import Any, Protocol

import numpy as np
import torch

from paratrain.errors import ConfigError

from ..config import _available_memory_bytes

__all__ = ["ByteCache", "MinIOCache", "LRUCache", "CachedDataset", "check_cache_fits", "simulate_hit_rate",
           "MAX_WORKERS"]

MAX_WORKERS = 256  # counter slots: the main process and up to this many loader workers


class ByteCache(Protocol):
    def get(self, index: int) -> bytes | None: ...

    def put(self, index: int, data: bytes) -> None: ...

    def hits_misses(self) -> tuple[int, int]: ...

    def reset_counters(self) -> None: ...


def _shm_free_bytes() -> int | None:
    import os

    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_cache_fits(capacity_bytes: int, field: str = "--cache-mb") -> None:
    """A cache this machine cannot hold in memory (or in /dev/shm) is refused before any is allocated."""
    if capacity_bytes < 0:
        raise ConfigError(field, f"must be at least 0, got {capacity_bytes / 2**20:g} MiB", "use e.g. 64")
    avail = _available_memory_bytes()
    shm = _shm_free_bytes()
    limit = avail if shm is None else min(avail, shm)
    if capacity_bytes > limit:
        raise ConfigError(field, f"a cache of {capacity_bytes / 2**20:,.0f} MiB is larger than the "
                          f"{limit / 2**20:,.0f} MiB of memory available (MemAvailable, /dev/shm free)",
                          "use a smaller cache (the dataset's uncached part is read from storage)")


def _worker_slot() -> int:
    info = torch.utils.data.get_worker_info()
    return 0 if info is None else 1 + info.id % MAX_WORKERS


class MinIOCache:
    """Shared-memory cache of a fixed set of items, never evicting.

    ``item_sizes``: every item's size in bytes (the slots are laid out from them). The cached set is
    the prefix of a permutation seeded by ``seed`` whose items fit ``capacity_bytes`` (greedily: an
    item too big for what is left is skipped). The creating process owns the shared memory and
    unlinks it on :meth:`close` (or at its exit).
    """

    def __init__(self, item_sizes: Sequence[int], capacity_bytes: int, *, seed: int = 0) -> None:
        check_cache_fits(capacity_bytes)
        n = len(item_sizes)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        offsets = np.full(n, -1, dtype=np.int64)
        used = 0
        for i in order:
            if used + item_sizes[i] <= capacity_bytes:
                offsets[i] = used
                used += item_sizes[i]
        self.capacity_bytes, self.used_bytes = capacity_bytes, used
        self.sizes = np.asarray(item_sizes, dtype=np.int64)
        self.offsets = offsets
        self.cached_items = int((offsets >= 0).sum())
        self._data = SharedMemory(create=True, size=max(used, 1))
        self._meta = SharedMemory(create=True, size=n + 16 * (MAX_WORKERS + 1))
        self._present = np.ndarray((n,), dtype=np.uint8, buffer=self._meta.buf)
        self._counts = np.ndarray((MAX_WORKERS + 1, 2), dtype=np.int64, buffer=self._meta.buf, offset=n)
        self._present[:] = 0
        self._counts[:] = 0
        self._finalizer = weakref.finalize(self, MinIOCache._release, self._data, self._meta)

    @staticmethod
    def _release(*blocks: SharedMemory) -> None:
        for b in blocks:
            b.close()
            with contextlib.suppress(FileNotFoundError):
                b.unlink()

    def close(self) -> None:
        # numpy views hold the buffers: drop them before the mappings go
        del self._present, self._counts
        self._finalizer()

    def __enter__(self) -> MinIOCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def is_cached(self, index: int) -> bool:
        """Whether ``index`` belongs to the cached set (filled or not yet)."""
        return bool(self.offsets[index] >= 0)

    def get(self, index: int) -> bytes | None:
        slot = _worker_slot()
        if self._present[index]:
            self._counts[slot, 0] += 1
            off = int(self.offsets[index])
            return bytes(self._data.buf[off:off + int(self.sizes[index])])
        self._counts[slot, 1] += 1
        return None

    def put(self, index: int, data: bytes) -> None:
        off = int(self.offsets[index])
        if off < 0 or self._present[index]:
            return
        if len(data) != self.sizes[index]:
            raise ValueError(f"item {index} has {len(data)} bytes, its slot {int(self.sizes[index])}")
        self._data.buf[off:off + len(data)] = data
        self._present[index] = 1  # after the bytes: a reader that sees the flag sees them

    def hits_misses(self) -> tuple[int, int]:
        hits, misses = self._counts.sum(axis=0)
        return int(hits), int(misses)

    def reset_counters(self) -> None:
        self._counts[:] = 0


class LRUCache:
    """Least-recently-used byte cache of ``capacity_bytes`` in this process (the page cache's policy)."""

    def __init__(self, capacity_bytes: int) -> None:
        check_cache_fits(capacity_bytes)
        self.capacity_bytes, self.used_bytes = capacity_bytes, 0
        self._items: OrderedDict[int, bytes] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, index: int) -> bytes | None:
        data = self._items.get(index)
        if data is None:
            self.misses += 1
            return None
        self._items.move_to_end(index)
        self.hits += 1
        return data

    def put(self, index: int, data: bytes) -> None:
        if len(data) > self.capacity_bytes or index in self._items:
            return
        while self.used_bytes + len(data) > self.capacity_bytes:
            _, old = self._items.popitem(last=False)
            self.used_bytes -= len(old)
        self._items[index] = data
        self.used_bytes += len(data)

    def hits_misses(self) -> tuple[int, int]:
        return self.hits, self.misses

    def reset_counters(self) -> None:
        self.hits = self.misses = 0


class CachedDataset:
    """A staged dataset whose ``fetch`` goes through ``cache`` first (miss: storage, then fill)."""

    def __init__(self, dataset: Any, cache: ByteCache) -> None:
        self.dataset, self.cache = dataset, cache

    @property
    def epoch(self) -> int:
        return int(self.dataset.epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def fetch(self, index: int) -> bytes:
        data = self.cache.get(index)
        if data is None:
            data = self.dataset.fetch(index)
            self.cache.put(index, data)
        return data

    def prep(self, raw: bytes, key: Any) -> Any:
        return self.dataset.prep(raw, key)

    def item_bytes(self, index: int) -> int:
        return int(self.dataset.item_bytes(index))

    def __getitem__(self, key: Any) -> Any:
        index = key[1] if isinstance(key, tuple) else key
        return self.prep(self.fetch(int(index)), key)


def simulate_hit_rate(cache: ByteCache, sizes: Sequence[int], *, epochs: int, seed: int = 0) -> list[float]:
    """Hit rate of each epoch when items of ``sizes`` are read in a fresh random order per epoch
    (seeded), filling ``cache`` on every miss: the policy alone, no storage and no decoding."""
    rates = []
    blobs = [bytes(s) for s in sizes]
    for e in range(epochs):
        cache.reset_counters()
        order = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed * 1_000_003 + e)).tolist()
        for i in order:
            if cache.get(i) is None:
                cache.put(i, blobs[i])
        hits, misses = cache.hits_misses()
        rates.append(hits / (hits + misses))
    return rates
