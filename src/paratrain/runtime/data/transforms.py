"""Image augmentations written for the input pipeline (Pillow in, torch tensor out).

The training transform is the usual ImageNet recipe: random resized crop (area scale (0.08, 1),
aspect ratio (3/4, 4/3), Szegedy et al. 2015 "Going deeper with convolutions", sec. 6), a
horizontal flip with probability 1/2, conversion to a float ``[C, H, W]`` tensor in [0, 1] and
normalization by the ImageNet channel means and standard deviations. Every random draw comes from
the ``torch.Generator`` the caller passes, so an item's augmentation is a function of that
generator's seed alone (whichever worker process prepares it).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "crop_box", "to_tensor", "normalize", "train_transform",
           "eval_transform"]

# ImageNet channel statistics of RGB in [0, 1] (the values torchvision's model zoo was trained with).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CROP_SCALE = (0.08, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
CROP_ATTEMPTS = 10  # tries at a legal box before the centre-crop fallback


def _uniform(gen: torch.Generator, lo: float, hi: float) -> float:
    return lo + (hi - lo) * float(torch.rand((), generator=gen, dtype=torch.float64))


def crop_box(width: int, height: int, gen: torch.Generator, scale: tuple[float, float] = CROP_SCALE,
             ratio: tuple[float, float] = CROP_RATIO) -> tuple[int, int, int, int]:
    """A random crop ``(left, top, crop_width, crop_height)`` covering a ``scale`` fraction of the
    image's area with aspect ratio in ``ratio`` (drawn log-uniformly); after ``CROP_ATTEMPTS``
    misses, the largest centred box whose ratio is clamped into ``ratio``."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(CROP_ATTEMPTS):
        target = area * _uniform(gen, *scale)
        aspect = math.exp(_uniform(gen, log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (), generator=gen))
            left = int(torch.randint(0, width - w + 1, (), generator=gen))
            return left, top, w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def to_tensor(img: Image.Image) -> torch.Tensor:
    """RGB image -> float32 ``[3, H, W]`` in [0, 1]."""
    arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(255.0)


def normalize(x_CHW: torch.Tensor, mean: tuple[float, ...] = IMAGENET_MEAN,
              std: tuple[float, ...] = IMAGENET_STD) -> torch.Tensor:
    m = torch.tensor(mean, dtype=x_CHW.dtype)[:, None, None]
    s = torch.tensor(std, dtype=x_CHW.dtype)[:, None, None]
    return (x_CHW - m) / s


def train_transform(img: Image.Image, size: int, gen: torch.Generator) -> torch.Tensor:
    """Random resized crop to ``size`` x ``size``, random horizontal flip, tensor, normalize."""
    left, top, w, h = crop_box(img.width, img.height, gen)
    out = img.resize((size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h))
    if _uniform(gen, 0.0, 1.0) < 0.5:  # a float64 draw: the flip must not depend on the default dtype
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return normalize(to_tensor(out))


def eval_transform(img: Image.Image, size: int) -> torch.Tensor:
    """Resize the short side to ``size`` and take the centre square (no randomness)."""
    scale = size / min(img.width, img.height)
    w, h = max(size, round(img.width * scale)), max(size, round(img.height * scale))
    out = img.resize((w, h), Image.Resampling.BILINEAR)
    left, top = (w - size) // 2, (h - size) // 2
    return normalize(to_tensor(out.crop((left, top, left + size, top + size))))
