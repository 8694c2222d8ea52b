"""Coordinated prep: 3 jobs on one dataset prepare each item once per epoch between them, every job
still sees every item once per epoch, in its own order, and the same prepared tensors."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from paratrain.runtime.data.coordinated import CoordinatedLoader
from paratrain.runtime.data.images import ImageFolder, generate_images

JOBS, ITEMS, BATCH, EPOCHS = 3, 48, 4, 2


def _job(root: str, store: str, job: int, out: mp.Queue) -> None:
    ds = ImageFolder(root, image_size=8, seed=7)
    loader = CoordinatedLoader(ds, store=store, job=job, jobs=JOBS, batch_size=BATCH, epochs=EPOCHS, seed=7,
                               window=6, timeout_s=60)
    seen = []
    for keys, (images, _labels) in loader:
        assert images.shape == (BATCH, 3, 8, 8)
        seen.extend((k, float(x.double().sum())) for k, x in zip(keys, images, strict=True))
    out.put((job, seen, loader.stats.prepared_items))


@pytest.mark.slow
def test_three_jobs_prepare_each_item_once_and_each_sees_a_permutation(tmp_path):
    generate_images(tmp_path / "d", ITEMS, 16, classes=4)
    store = tmp_path / "store"
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_job, args=(str(tmp_path / "d"), str(store), j, out)) for j in range(JOBS)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        job, seen, prepared = out.get(timeout=120)
        results[job] = (seen, prepared)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    # one job's worth of preparation in total: each item once per epoch, split between the jobs
    assert sum(prepared for _, prepared in results.values()) == ITEMS * EPOCHS
    assert all(prepared > 0 for _, prepared in results.values())
    ds = ImageFolder(tmp_path / "d", image_size=8, seed=7)
    orders = []
    for seen, _ in results.values():
        for e in range(EPOCHS):
            idx = [i for (ep, i), _ in seen if ep == e]
            assert sorted(idx) == list(range(ITEMS))  # a permutation per epoch
            orders.append(idx)
        for (ep, i), checksum in seen[:5]:  # what a job got is what the dataset prepares for that key
            assert checksum == pytest.approx(float(ds[(ep, i)][0].double().sum()), abs=1e-9)
    sums = {}
    for seen, _ in results.values():
        for key, checksum in seen:
            assert sums.setdefault(key, checksum) == checksum  # every job the same tensor
    assert len({tuple(o) for o in orders[:EPOCHS * JOBS:EPOCHS]}) == JOBS  # each job its own order
    assert not list(Path(store).glob("*.batch"))  # the last reader freed every batch
