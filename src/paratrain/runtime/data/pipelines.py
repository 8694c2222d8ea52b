"""The pipelines ``paratrain data analyze`` measures: the built-in image pipeline (optionally on
throttled storage and behind a MinIO cache) or a user's ``module:function`` returning a DataLoader,
and the compute step that consumes their batches."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paratrain.errors import ConfigError

from ..models.cnn import build_cnn
from .analyzer import Compute, StallReport, analyze_dataset, analyze_loader, model_compute, sleep_compute
from .images import ImageFolder, ThrottledReader, read_file
from .minio import CachedDataset, MinIOCache

__all__ = ["AnalyzeOptions", "load_user_pipeline", "analyze_pipeline", "BUILTIN"]

BUILTIN = "image"
USER_CLASSES = 1000  # the CNN's classes for a user's pipeline (labels are whatever it yields)


@dataclass(frozen=True)
class AnalyzeOptions:
    pipeline: str = BUILTIN
    data: str | None = None
    batch_size: int = 16
    workers: int = 2
    batches: int = 16
    warmup: int | None = None
    image_size: int = 32
    fetch_ms: float = 0.0
    compute_ms: float | None = None  # None: the CNN's own step
    cache_mb: float = 0.0
    seed: int = 0
    drop_caches: bool = True

    def __post_init__(self) -> None:
        for flag, value in (("--batch-size", self.batch_size), ("--batches", self.batches)):
            if value < 1:
                raise ConfigError(flag, f"must be at least 1, got {value}", f"use e.g. {flag} 16")
        if self.workers < 0:
            raise ConfigError("--workers", f"must be at least 0, got {self.workers}", "use e.g. --workers 2")
        if self.warmup is not None and self.warmup < 0:
            raise ConfigError("--warmup", f"must be at least 0, got {self.warmup}", "use e.g. --warmup 2")
        for flag, x in (("--fetch-ms", self.fetch_ms), ("--cache-mb", self.cache_mb)):
            if not x >= 0:
                raise ConfigError(flag, f"must be at least 0, got {x}", f"use e.g. {flag} 0")
        if self.compute_ms is not None and not self.compute_ms > 0:
            raise ConfigError("--compute-ms", f"must be positive, got {self.compute_ms}",
                              "use e.g. --compute-ms 20 (or leave it out: the CNN's step)")


def load_user_pipeline(spec: str) -> Callable[[], torch.utils.data.DataLoader]:
    """``module:function`` (importable from the current directory) -> the function, which takes no
    argument and returns a fresh ``torch.utils.data.DataLoader`` on every call."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ConfigError("--pipeline", f"{spec!r} is not 'image' or 'module:function'",
                          "e.g. --pipeline my_pipeline:make_loader")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError("--pipeline", f"cannot import {module!r}: {e}",
                          "run from the directory holding the module, or install it") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ConfigError("--pipeline", f"{module!r} has no function {name!r}", "name a function of the module")

    def make() -> torch.utils.data.DataLoader:
        loader = fn()
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise ConfigError("--pipeline", f"{spec} returned {type(loader).__name__}, not a "
                              "torch.utils.data.DataLoader", "make the function return a DataLoader")
        return loader

    return make


def _compute(opts: AnalyzeOptions, classes: int, sample: Any) -> Compute:
    if opts.compute_ms is not None:
        return sleep_compute(opts.compute_ms / 1e3)
    step = model_compute(build_cnn(classes, opts.seed))
    try:
        step(sample)
    except (TypeError, ValueError, RuntimeError, IndexError) as e:
        raise ConfigError("--compute-ms", f"the CNN cannot train on this pipeline's batches ({type(e).__name__})",
                          "give the compute step's time instead, e.g. --compute-ms 20") from None
    return step


def analyze_pipeline(opts: AnalyzeOptions) -> StallReport:
    """The differential measurement (:mod:`.analyzer`) of the pipeline ``opts`` names."""
    if opts.pipeline != BUILTIN:
        make = load_user_pipeline(opts.pipeline)
        first = next(iter(make()))
        compute = _compute(opts, USER_CLASSES, first)
        return analyze_loader(make, compute, batches=opts.batches, warmup=1 if opts.warmup is None else opts.warmup,
                              data=opts.data, allow_drop=opts.drop_caches)
    if opts.data is None:
        raise ConfigError("--data", "the image pipeline needs a directory of images",
                          "write one with `paratrain data generate --items 512 --out DIR`, then --data DIR")
    reader = ThrottledReader(opts.fetch_ms / 1e3) if opts.fetch_ms > 0 else read_file
    images = ImageFolder(opts.data, image_size=opts.image_size, seed=opts.seed, reader=reader)
    sample = torch.utils.data.default_collate([images[i] for i in range(min(opts.batch_size, len(images)))])
    compute = _compute(opts, images.num_classes, sample)
    if opts.cache_mb <= 0:
        return analyze_dataset(images, compute, batch_size=opts.batch_size, batches=opts.batches,
                               workers=opts.workers, warmup=opts.warmup, seed=opts.seed,
                               allow_drop=opts.drop_caches)
    with MinIOCache([images.item_bytes(i) for i in range(len(images))], int(opts.cache_mb * 2**20),
                    seed=opts.seed) as cache:
        for i in range(len(images)):  # the steady state after epoch 1: the cached set is filled
            if cache.is_cached(i):
                cache.put(i, read_file(images.files[i]))
        return analyze_dataset(CachedDataset(images, cache), compute, batch_size=opts.batch_size,
                               batches=opts.batches, workers=opts.workers, warmup=opts.warmup, seed=opts.seed,
                               allow_drop=opts.drop_caches)
