"""An image-folder dataset of JPEG files, its generator, and the DataLoader around it.

Layout on disk (what ``paratrain data generate`` writes and :class:`ImageFolder` reads)::

    DIR/class_000/000000.jpg
    DIR/class_001/000001.jpg
    ...

Items are split into the two stages DS-Analyzer measures apart (Mohan et al., VLDB'21, sec. 3):
:meth:`ImageFolder.fetch` reads an item's bytes from storage and :meth:`ImageFolder.prep` decodes
and augments them on the CPU. Indexing with ``dataset[i]`` does both; the caches of this package
wrap ``fetch`` and leave ``prep`` alone (:class:`StagedDataset`).

An item's augmentation is drawn from a generator seeded by ``(seed, epoch, index)`` (:func:`item_seed`):
the same item of the same epoch is the same tensor whichever worker process, rank or job prepares it.
A key is an index (the dataset's current :attr:`ImageFolder.epoch`) or an ``(epoch, index)`` pair.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

from paratrain.errors import ConfigError
from paratrain.fileio import atomic_write_bytes, check_output_dir

from .transforms import eval_transform, train_transform

__all__ = ["IMAGE_SUFFIXES", "StagedDataset", "ImageFolder", "GeneratedSet", "generate_images", "item_seed",
           "split_key", "ThrottledReader", "read_file", "make_loader", "EpochSampler"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
Key = int | tuple[int, int]


def item_seed(seed: int, epoch: int, index: int) -> int:
    # Large odd multipliers keep (seed, epoch, index) triples apart for any realistic dataset.
    return (seed * 1_000_003 + epoch) * 2_147_483_647 + index


def split_key(key: Key, epoch: int) -> tuple[int, int]:
    """``(epoch, index)`` of a key: a bare index belongs to ``epoch``."""
    if isinstance(key, tuple):
        return int(key[0]), int(key[1])
    return epoch, int(key)


class StagedDataset(Protocol):
    """A map-style dataset whose items are fetched (storage -> bytes) and then prepared (bytes ->
    sample) in two calls, so a cache can stand between the two and an analyzer can time them apart."""

    epoch: int

    def __len__(self) -> int: ...

    def fetch(self, index: int) -> bytes: ...

    def prep(self, raw: bytes, key: Key) -> Any: ...

    def item_bytes(self, index: int) -> int: ...


def read_file(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


@dataclass(frozen=True)
class ThrottledReader:
    """Storage of known speed: each read costs ``delay_s`` of waiting on top of the file read
    (a slow disk or a remote store seen from one client; the analyzer's ground truth)."""

    delay_s: float

    def __call__(self, path: Path) -> bytes:
        time.sleep(self.delay_s)
        return read_file(path)


def list_images(root: Path) -> tuple[list[Path], list[int], list[str]]:
    """The image files under ``root`` (sorted), their class labels, and the class names: every
    sub-directory holding images is a class; images directly in ``root`` form one class ``.``."""
    files: list[Path] = []
    labels: list[int] = []
    classes: list[str] = []
    by_dir: dict[str, list[Path]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        found = sorted(Path(dirpath) / f for f in filenames if f.lower().endswith(IMAGE_SUFFIXES))
        if found:
            by_dir[Path(dirpath).relative_to(root).as_posix()] = found
    for label, name in enumerate(sorted(by_dir)):
        classes.append(name)
        files.extend(by_dir[name])
        labels.extend([label] * len(by_dir[name]))
    return files, labels, classes


class ImageFolder:
    """JPEG/PNG files under ``root`` (one sub-directory per class), decoded and augmented to
    ``[3, image_size, image_size]`` float tensors; items are ``(image_CHW, label)``.

    ``reader`` reads one file's bytes (default: a plain read; :class:`ThrottledReader` for storage of
    known speed). ``train=False`` takes the deterministic centre crop instead of the augmentation.
    ``dtype`` is the images' dtype (float64 for the equivalence tests).
    """

    def __init__(self, root: str | os.PathLike[str], *, image_size: int = 32, seed: int = 0, train: bool = True,
                 reader: Callable[[Path], bytes] = read_file, dtype: torch.dtype = torch.float32,
                 field: str = "--data") -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ConfigError(field, f"{str(root)!r} is not a directory",
                              "give a directory of images, e.g. one from `paratrain data generate`")
        self.files, self.labels, self.classes = list_images(self.root)
        if not self.files:
            raise ConfigError(field, f"no images ({', '.join(IMAGE_SUFFIXES)}) under {str(root)!r}",
                              f"write some with `paratrain data generate --items 512 --out {root}`")
        if image_size < 8:
            raise ConfigError("--image-size", f"must be at least 8, got {image_size}", "use e.g. --image-size 32")
        self.image_size, self.seed, self.train = image_size, seed, train
        self.reader, self.dtype = reader, dtype
        self.epoch = 0
        self._sizes: list[int] | None = None

    def __len__(self) -> int:
        return len(self.files)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def item_bytes(self, index: int) -> int:
        if self._sizes is None:
            self._sizes = [f.stat().st_size for f in self.files]
        return self._sizes[index]

    def total_bytes(self) -> int:
        return sum(self.item_bytes(i) for i in range(len(self)))

    def fetch(self, index: int) -> bytes:
        return self.reader(self.files[index])

    def prep(self, raw: bytes, key: Key) -> tuple[torch.Tensor, int]:
        epoch, index = split_key(key, self.epoch)
        with Image.open(io.BytesIO(raw)) as img:
            img.draft("RGB", (self.image_size, self.image_size))  # JPEG: decode at a reduced scale when it can
            img = img.convert("RGB")
            if self.train:
                gen = torch.Generator().manual_seed(item_seed(self.seed, epoch, index))
                x = train_transform(img, self.image_size, gen)
            else:
                x = eval_transform(img, self.image_size)
        return x.to(self.dtype), self.labels[index]

    def __getitem__(self, key: Key) -> tuple[torch.Tensor, int]:
        _, index = split_key(key, self.epoch)
        return self.prep(self.fetch(index), key)


class EpochSampler(torch.utils.data.Sampler[tuple[int, int]]):
    """Keys ``(epoch, index)`` in a random order per epoch, seeded by ``(seed, epoch)``: epoch ``e``
    is a permutation of the dataset whatever the loader's workers, and tags every item with its epoch."""

    def __init__(self, size: int, *, seed: int = 0, epochs: int = 1, start_epoch: int = 0,
                 shuffle: bool = True) -> None:
        self.size, self.seed, self.epochs, self.start_epoch, self.shuffle = size, seed, epochs, start_epoch, shuffle

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.size, generator=gen).tolist()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for e in range(self.start_epoch, self.start_epoch + self.epochs):
            yield from ((e, i) for i in self.order(e))

    def __len__(self) -> int:
        return self.size * self.epochs


def make_loader(dataset: Any, *, batch_size: int, workers: int = 0, sampler: Any = None,
                batch_sampler: Any = None, prefetch_factor: int | None = None) -> torch.utils.data.DataLoader:
    """A DataLoader with ``workers`` worker processes (0: in this process) over ``dataset``."""
    kwargs: dict[str, Any] = {"num_workers": workers}
    if workers > 0 and prefetch_factor is not None:
        kwargs["prefetch_factor"] = prefetch_factor
    if batch_sampler is not None:
        return torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler, **kwargs)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **kwargs)


# ----- the generator ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class GeneratedSet:
    root: Path
    items: int
    classes: int
    image_size: int
    total_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"root": str(self.root), "items": self.items, "classes": self.classes,
                "image_size": self.image_size, "total_bytes": self.total_bytes}


def _picture(label: int, classes: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """An RGB picture whose class shows in its colour and stripe direction (learnable), with noise
    and a random bright rectangle so that JPEG sizes and crops vary like photographs' do."""
    hue = 2 * np.pi * label / classes
    base = 127 + 90 * np.array([np.cos(hue), np.cos(hue + 2.1), np.cos(hue + 4.2)])
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    angle = np.pi * label / classes
    stripes = 40 * np.sin(2 * np.pi * 4 * (xx * np.cos(angle) + yy * np.sin(angle)))
    img = base[None, None, :] + stripes[..., None] + rng.normal(0, 18, (size, size, 3))
    x0, y0 = rng.integers(0, size // 2, 2)
    w, h = rng.integers(size // 8, size // 2, 2)
    img[y0:y0 + h, x0:x0 + w] += 60
    return np.clip(img, 0, 255).astype(np.uint8)


_MAX_ITEMS = 1_000_000
_MAX_IMAGE_SIZE = 4096


def generate_images(out: str | os.PathLike[str], items: int, image_size: int = 64, *, classes: int = 10,
                    seed: int = 0, quality: int = 90) -> GeneratedSet:
    """Write ``items`` JPEGs of ``image_size`` x ``image_size`` into ``out`` (``class_XXX/NNNNNN.jpg``,
    item ``i`` of class ``i mod classes``). Refuses a directory that already holds files."""
    # The upper bounds keep a typo from writing images until the disk is full.
    if not 1 <= items <= _MAX_ITEMS:
        raise ConfigError("--items", f"must be in 1..{_MAX_ITEMS:,}, got {items:,}", "use e.g. --items 512")
    if not 8 <= image_size <= _MAX_IMAGE_SIZE:
        raise ConfigError("--image-size", f"must be in 8..{_MAX_IMAGE_SIZE}, got {image_size:,}",
                          "use e.g. --image-size 64")
    if classes < 1:
        raise ConfigError("--classes", f"must be at least 1, got {classes}", "use e.g. --classes 10")
    if not 1 <= quality <= 95:
        raise ConfigError("--quality", f"must be in 1..95, got {quality}", "use e.g. --quality 90")
    root = check_output_dir(out, "--out")
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigError("--out", f"{str(out)!r} exists and is not an empty directory",
                          "give a new or empty directory (nothing is overwritten)")
    try:  # an unwritable place fails here, before the first picture
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError("--out", f"cannot create directory {str(out)!r}: {e.strerror or e}",
                          "choose a writable location") from None
    rng = np.random.default_rng(seed)
    total = 0
    for i in range(items):
        label = i % classes
        buf = io.BytesIO()
        Image.fromarray(_picture(label, classes, image_size, rng)).save(buf, format="JPEG", quality=quality)
        data = buf.getvalue()
        path = root / f"class_{label:03d}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data, "--out")
        total += len(data)
    return GeneratedSet(root, items, min(classes, items), image_size, total)
