"""MinIO (CoorDL's cache) against LRU under a random order per epoch."""

from __future__ import annotations

import pytest

from paratrain.errors import ConfigError
from paratrain.runtime.data.images import EpochSampler, ImageFolder, generate_images, make_loader
from paratrain.runtime.data.minio import CachedDataset, LRUCache, MinIOCache, check_cache_fits, simulate_hit_rate

D, ITEM = 1000, 1000


def test_minio_hit_rate_is_the_cached_share_and_lru_thrashes():
    sizes = [ITEM] * D
    with MinIOCache(sizes, D * ITEM // 2, seed=1) as minio:
        rates = simulate_hit_rate(minio, sizes, epochs=3)
        assert minio.cached_items == D // 2
    # epoch 1 fills the cache (compulsory misses); after it, exactly cache / D
    assert rates == [0.0, 0.5, 0.5]
    lru = simulate_hit_rate(LRUCache(D * ITEM // 2), sizes, epochs=3)
    assert lru[0] == 0.0
    # an item hits only if fewer than C distinct items were read since its last use: for C = D/2 and
    # independent uniform positions that is P(u - t >= D/2) = 1/8 in expectation
    assert all(0.08 < r < 0.25 for r in lru[1:])


def test_minio_never_evicts_and_fills_to_its_capacity():
    sizes = [300, 500, 200, 700, 100]
    with MinIOCache(sizes, 1000, seed=0) as m:
        assert m.used_bytes <= 1000
        cached = [i for i in range(len(sizes)) if m.is_cached(i)]
        assert sum(sizes[i] for i in cached) == m.used_bytes
        for _epoch in range(3):
            for i in range(len(sizes)):
                if m.get(i) is None:
                    m.put(i, bytes([i]) * sizes[i])
        for i in cached:  # the first epoch's bytes are all still there
            assert m.get(i) == bytes([i]) * sizes[i]


def test_loader_workers_share_one_minio_cache(tmp_path):
    """Two forked DataLoader workers fill the one shared-memory cache in epoch 1; in epoch 2 every
    worker hits on the whole cached set: the hit rate is exactly cached / D."""
    generate_images(tmp_path / "d", 40, 16, classes=4)
    ds = ImageFolder(tmp_path / "d", image_size=8)
    total = ds.total_bytes()
    with MinIOCache([ds.item_bytes(i) for i in range(len(ds))], total // 2) as cache:
        cached = CachedDataset(ds, cache)
        for epoch in range(2):
            cache.reset_counters()
            sampler = EpochSampler(len(ds), seed=3, epochs=1, start_epoch=epoch)
            n = sum(len(y) for _, y in make_loader(cached, batch_size=4, workers=2, sampler=sampler))
            assert n == len(ds)
            hits, misses = cache.hits_misses()
            assert hits + misses == len(ds)
            assert hits == (0 if epoch == 0 else cache.cached_items)
        assert 0 < cache.cached_items < len(ds)


def test_a_cache_larger_than_memory_is_refused():
    with pytest.raises(ConfigError) as e:
        check_cache_fits(2**62)
    assert e.value.field == "--cache-mb"
    assert "larger than" in e.value.problem
    with pytest.raises(ConfigError):
        MinIOCache([1, 2], 2**62)
