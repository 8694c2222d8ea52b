"""The partitioned cache over torch.distributed: 2 processes (gloo) stand in for 2 nodes."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from paratrain.runtime.data.image_task import StepBatches
from paratrain.runtime.data.images import ImageFolder, generate_images
from paratrain.runtime.data.partitioned import PartitionedCache, owners

ITEMS, WORLD, GLOBAL_BATCH = 32, 2, 8
STEPS_PER_EPOCH = ITEMS // GLOBAL_BATCH


def _node(rank: int, root: str, init: str, capacity: int, out: mp.Queue) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    ds = ImageFolder(root, image_size=8)
    cache = PartitionedCache(ds, capacity_items=capacity, seed=3)
    samplers = [StepBatches(ITEMS, seed=1, steps=2 * STEPS_PER_EPOCH, global_batch=GLOBAL_BATCH, dp_rank=r, dp=WORLD)
                for r in range(WORLD)]
    per_epoch, ok = [], True
    for epoch in range(2):
        before = (cache.stats.storage_reads, cache.stats.remote_hits, cache.stats.local_hits)
        for step in range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH):
            needs = [s.step_keys(step) for s in samplers]
            raws = cache.fetch([[i for _, i in keys] for keys in needs])
            ok &= raws == [ds.files[i].read_bytes() for _, i in needs[rank]]
            images = cache.batch(needs)
            ok &= all(torch.equal(x, ds[key][0]) for (x, _), key in zip(images, needs[rank], strict=True))
        after = (cache.stats.storage_reads, cache.stats.remote_hits, cache.stats.local_hits)
        per_epoch.append(tuple(a - b for a, b in zip(after, before, strict=True)))
    out.put((rank, ok, per_epoch, cache.stats.served))
    dist.barrier()
    dist.destroy_process_group()


def _run(tmp_path: Path, capacity: int) -> dict[int, tuple]:
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    init = f"file://{tmp_path}/pg-{capacity}"
    procs = [ctx.Process(target=_node, args=(r, str(tmp_path / "d"), init, capacity, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, *rest = out.get(timeout=120)
        results[rank] = tuple(rest)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


@pytest.mark.slow
@pytest.mark.dist
def test_nodes_serve_their_shard_to_each_other(tmp_path):
    generate_images(tmp_path / "d", ITEMS, 16, classes=4)
    # aggregate cache = the dataset (16 items a node): after epoch 1 no node reads storage
    full = _run(tmp_path, ITEMS // WORLD)
    for rank, (ok, per_epoch, served) in full.items():
        assert ok, f"rank {rank} got bytes or images other than the files'"
        (reads1, remote1, _), (reads2, remote2, local2) = per_epoch
        assert reads1 > 0 and reads2 == 0
        # its half of the epoch, twice (fetch, then batch), all from the caches
        assert remote2 > 0 and remote2 + local2 == 2 * (ITEMS // WORLD)
        assert served > 0
    # every item of the dataset read from storage exactly once in epoch 1, by its owner
    assert sum(r[1][0][0] for r in full.values()) == ITEMS
    # aggregate cache = half the dataset: epoch 2 reads exactly the uncached half from storage (twice:
    # fetch, then batch; nothing caches what no node owns)
    half = _run(tmp_path, ITEMS // (2 * WORLD))
    uncached = sum(o is None for o in owners(ITEMS, WORLD, ITEMS // (2 * WORLD), 3))
    assert uncached == ITEMS // 2
    assert sum(r[1][1][0] for r in half.values()) == 2 * uncached
