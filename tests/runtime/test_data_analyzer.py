"""DS-Analyzer's differential method recovers stalls built into a pipeline by construction.

The ground-truth pipeline: files on disk read through storage that waits ``FETCH_S`` per item
(:class:`ThrottledReader`), a preparation that takes ``PREP_S`` per item, a compute step of
``COMPUTE_S`` per batch, ``WORKERS`` loader workers each preparing whole batches of ``B`` items.
Then, in the steady state (after the warm-up batches),

    synthetic run  T1 = N * COMPUTE_S
    cached run     T3 = N * B * PREP_S / WORKERS             (prep-bound: B*PREP_S/WORKERS > COMPUTE_S)
    cold run       T2 = N * B * (FETCH_S + PREP_S) / WORKERS

so prep stall = T3 - T1 and fetch stall = T2 - T3, each known in closed form.

Why sleeps: the per-item costs wait instead of burning CPU. A busy loop's duration on this 2-core
machine depends on what else runs (other test processes), so its "known" cost would not be known;
a wait of 40 ms is the same under load, and 2 workers never need more than the cores there are.
The files are read through the page cache (the dataset exposes no file list, so the cold run has
nothing to evict: ``cold_method == "uncached"``): a real disk read under heavy I/O from other jobs
adds milliseconds the construction does not know. (The fresh-copy path is exercised by
tests/cli/test_data_cli.py.) The remaining noise is the loader's own overhead (IPC, a few ms per
batch under load), which the costs are chosen to dwarf: 10 % of each stall is 6-8 ms per batch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from paratrain.runtime.data.analyzer import analyze_dataset, analyze_loader, sleep_compute
from paratrain.runtime.data.images import ThrottledReader
from paratrain.runtime.data.stats import cpu_cores
from paratrain.runtime.data.whatif import measured_from, predict

FETCH_S, PREP_S, COMPUTE_S = 0.04, 0.04, 0.02
B, WORKERS, N, WARMUP = 4, 2, 16, 2


class GroundTruth:
    """A staged dataset of raw files with known fetch and prep costs (no ``files``/``root``: the
    analyzer has nothing to evict, the throttle is the whole fetch cost)."""

    def __init__(self, root: Path, fetch_s: float, prep_s: float) -> None:
        self.paths = sorted(root.glob("*.bin"))
        self.reader = ThrottledReader(fetch_s)
        self.prep_s = prep_s
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.paths)

    def fetch(self, index: int) -> bytes:
        return self.reader(self.paths[index])

    def prep(self, raw: bytes, key: object) -> torch.Tensor:
        time.sleep(self.prep_s)
        return torch.frombuffer(bytearray(raw[:16]), dtype=torch.uint8).float()

    def item_bytes(self, index: int) -> int:
        return self.paths[index].stat().st_size

    def __getitem__(self, key: object) -> torch.Tensor:
        index = key[1] if isinstance(key, tuple) else key
        return self.prep(self.fetch(int(index)), key)


def _files(root: Path, n: int) -> Path:
    root.mkdir()
    for i in range(n):
        (root / f"{i:04d}.bin").write_bytes(bytes(range(256)) * 8)
    return root


def _overloaded() -> bool:
    # More than 8 runnable tasks per core: a woken worker then waits tens of ms for a core (measured:
    # at load 31 on 2 cores the prep stall came out 39 % long), so no timing here means anything.
    return os.getloadavg()[0] > 8 * cpu_cores()


@pytest.mark.slow
@pytest.mark.skipif(_overloaded(), reason="machine overloaded (load average > 8 per core): timings meaningless")
def test_analyzer_recovers_known_prep_and_fetch_stalls(tmp_path):
    ds = GroundTruth(_files(tmp_path / "data", (WARMUP + N) * B + 4), FETCH_S, PREP_S)
    # allow_drop=False: a test never drops the page cache of the whole machine
    report = analyze_dataset(ds, sleep_compute(COMPUTE_S), batch_size=B, batches=N, workers=WORKERS, warmup=WARMUP,
                             allow_drop=False)

    t1 = N * COMPUTE_S
    t3 = N * B * PREP_S / WORKERS
    t2 = N * B * (FETCH_S + PREP_S) / WORKERS
    items = N * B
    scale = len(ds) / items
    assert report.prep_stall_s == pytest.approx((t3 - t1) * scale, rel=0.10)
    assert report.fetch_stall_s == pytest.approx((t2 - t3) * scale, rel=0.10)
    assert report.prep_stall_fraction == pytest.approx((t3 - t1) / t2, rel=0.10)
    assert report.fetch_stall_fraction == pytest.approx((t2 - t3) / t2, rel=0.10)
    assert report.compute_rate_items_s == pytest.approx(items / t1, rel=0.10)
    assert report.prep_rate_items_s == pytest.approx(items / t3, rel=0.10)
    assert report.fetch_rate_items_s == pytest.approx(WORKERS / FETCH_S, rel=0.10)
    # without compute the loader prepares at its own capacity: WORKERS items per PREP_S. 20 %: this
    # run has no compute wait for the main process's per-batch overhead to hide behind, and at
    # load averages of 20 on these 2 cores it measured 16 % slow once (a rate the what-if scales,
    # not one of the stalls the issue bounds at 10 %)
    assert report.prep_capacity_items_s == pytest.approx(WORKERS / PREP_S, rel=0.20)
    assert report.cold_method == "uncached"
    assert report.avg_item_bytes == 2048

    # the what-if model at the measured configuration reproduces the measured epoch
    base = predict(measured_from(report), cache_fraction=0.0)
    assert base.epoch_time_s == pytest.approx(report.epoch_time_s, rel=0.10)
    # everything cached: the fetch stall goes, the prep stall stays
    full = predict(measured_from(report), cache_fraction=1.0)
    assert full.fetch_stall_fraction < 0.01
    assert full.prep_stall_s == pytest.approx(report.prep_stall_s, rel=0.10)


def test_a_user_loader_is_timed_as_it_is(tmp_path):
    """A plain DataLoader (no fetch/prep split) still gets the four runs; with in-memory data
    and no storage there is no fetch stall to find."""
    data = torch.arange(64, dtype=torch.float32).reshape(32, 2)

    def make() -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)

    report = analyze_loader(make, sleep_compute(0.002), batches=4, warmup=1, allow_drop=False)
    assert report.cached_method == "page_cache"
    assert report.compute_rate_items_s > 0
    assert report.dataset_items == 32
