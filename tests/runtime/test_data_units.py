"""The pieces of the input pipeline with a rule or a formula: the crop's scale and ratio rules, an
item's augmentation as a function of its seed, the what-if model against hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.runtime.data.images import ImageFolder, generate_images
from paratrain.runtime.data.transforms import CROP_RATIO, CROP_SCALE, crop_box
from paratrain.runtime.data.whatif import Measured, predict


@pytest.mark.parametrize("width, height", [(64, 64), (200, 50), (37, 120)])
def test_random_resized_crop_keeps_its_scale_and_ratio_rules(width, height):
    """Every box lies in the image; a drawn box covers 8-100 % of it with a ratio in [3/4, 4/3] (10 %
    slack: sides are rounded to whole pixels, ~0.5 px on a 15-px side); otherwise it is the centred
    fallback, as wide or as tall as the image."""
    gen = torch.Generator().manual_seed(0)
    drawn = 0
    for _ in range(300):
        left, top, w, h = crop_box(width, height, gen)
        assert left >= 0 and left + w <= width and top >= 0 and top + h <= height
        fallback = (left, top) == ((width - w) // 2, (height - h) // 2) and (w == width or h == height)
        area, ratio = w * h / (width * height), w / h
        in_rules = 0.9 * CROP_SCALE[0] <= area <= 1 and 0.9 * CROP_RATIO[0] <= ratio <= 1.1 * CROP_RATIO[1]
        assert in_rules or fallback, (left, top, w, h)
        drawn += in_rules
    assert drawn > 150  # the fallback is the exception even for a 4:1 image


def test_a_square_image_never_needs_the_fallback():
    # any area fraction in [0.08, 1] with a ratio in [3/4, 4/3] fits a square in at least one of 10 tries
    # often enough: over 1000 draws the centred fallback (full square) stays rare
    gen = torch.Generator().manual_seed(1)
    boxes = [crop_box(100, 100, gen) for _ in range(1000)]
    areas = [w * h / 1e4 for _, _, w, h in boxes]
    assert min(areas) >= CROP_SCALE[0] - 0.01
    assert sum(a == 1.0 for a in areas) < 50
    ratios = [w / h for _, _, w, h in boxes]
    assert min(ratios) >= CROP_RATIO[0] - 0.03 and max(ratios) <= CROP_RATIO[1] + 0.03
    # log-uniform ratio: as many boxes wider than tall as taller than wide
    wide = sum(r > 1 for r in ratios)
    assert abs(wide - sum(r < 1 for r in ratios)) < 120


def test_an_items_augmentation_is_a_function_of_seed_epoch_and_index(tmp_path):
    generate_images(tmp_path / "d", 8, 32, classes=2)
    a = ImageFolder(tmp_path / "d", image_size=16, seed=3)
    b = ImageFolder(tmp_path / "d", image_size=16, seed=3)
    x, label = a[(1, 5)]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and label == 1
    assert torch.equal(x, b[(1, 5)][0])
    assert not torch.equal(x, a[(2, 5)][0])  # another epoch, another crop
    assert not torch.equal(x, ImageFolder(tmp_path / "d", image_size=16, seed=4)[(1, 5)][0])
    centre = ImageFolder(tmp_path / "d", image_size=16, train=False)
    assert torch.equal(centre[(0, 5)][0], centre[(7, 5)][0])  # no randomness without augmentation


def test_generate_refuses_a_directory_with_files(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError) as e:
        generate_images(tmp_path / "x", 4, 16)
    assert e.value.field == "--out"
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


M = Measured(dataset_items=1000, avg_item_bytes=1000.0, compute_rate_items_s=500.0, prep_capacity_items_s=200.0,
             workers=2, cores=4, storage_bytes_s=1e6, memory_bytes_s=1e9)


def test_whatif_against_hand_worked_numbers():
    # compute 1000/500 = 2 s; prep with 4 workers: 100 items/s a worker -> 1000/400 = 2.5 s;
    # fetch: 500 items x 1 kB from 1 MB/s storage = 0.5 s + 500 kB from 1 GB/s memory = 0.0005 s
    p = predict(M, cache_fraction=0.5, workers=4)
    assert p.epoch_time_s == pytest.approx(2.5 + 0.5005)
    assert p.prep_stall_s == pytest.approx(0.5)
    assert p.fetch_stall_s == pytest.approx(0.5005)
    assert p.throughput_items_s == pytest.approx(1000 / 3.0005)
    # 8 workers on 4 cores prepare no faster than 4
    assert predict(M, cache_fraction=0.5, workers=8).epoch_time_s == pytest.approx(p.epoch_time_s)
    # as measured (2 workers: prep 5 s), nothing cached: 5 + 1 s
    assert predict(M, cache_fraction=0.0).epoch_time_s == pytest.approx(6.0)
    # faster storage shrinks only the fetch term
    assert predict(M, cache_fraction=0.0, storage_bytes_s=1e7).fetch_stall_s == pytest.approx(0.1)
    assert math.isclose(predict(M, cache_fraction=1.0).fetch_stall_s, 0.001)


@pytest.mark.parametrize("kw, field", [({"cache_fraction": 1.5}, "--cache-fraction"),
                                       ({"cache_fraction": 0.5, "workers": -1}, "--workers"),
                                       ({"cache_fraction": 0.5, "storage_bytes_s": 0.0}, "--bandwidth-mbs")])
def test_whatif_bad_input(kw, field):
    with pytest.raises(ConfigError) as e:
        predict(M, **kw)
    assert e.value.field == field


def test_an_items_augmentation_does_not_depend_on_the_default_dtype(tmp_path):
    """A loader worker started by spawn or forkserver has float32 as its default dtype while a
    float64 run's main process has float64: the crop and the flip must be drawn alike in both."""
    generate_images(tmp_path / "d", 8, 32, classes=2)
    keys = [(e, i) for e in range(3) for i in range(8)]
    as32 = [ImageFolder(tmp_path / "d", image_size=16, seed=3, dtype=torch.float64)[k][0] for k in keys]
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        as64 = [ImageFolder(tmp_path / "d", image_size=16, seed=3, dtype=torch.float64)[k][0] for k in keys]
    finally:
        torch.set_default_dtype(before)
    assert all(torch.equal(a, b) for a, b in zip(as32, as64, strict=True))
