"""A small ResNet-like CNN for the image task (the input pipeline's consumer).

Legend: B batch, C channels, H/W height/width, K classes.

Layout follows ResNet (He et al. 2016, "Deep Residual Learning", table 1) scaled down for 32 px
inputs on a CPU: a 3x3 stem, three stages of one basic block each (two 3x3 convolutions and a
skip connection; stride 2 and a 1x1 projection where the width doubles), global average pooling
and a linear classifier. GroupNorm stands in for BatchNorm: it holds no running statistics and
does not depend on the batch, so data-parallel replicas compute exactly what one process computes
on the same micro-batches (Wu & He 2018, "Group Normalization").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ResNetTiny", "build_cnn", "GROUPS"]

GROUPS = 8  # GroupNorm groups: the paper's default is 32, our narrowest stage has 16 channels


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(GROUPS, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(GROUPS, c_out)
        self.proj: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.proj = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.GroupNorm(GROUPS, c_out))

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x_BCHW)))
        y = self.norm2(self.conv2(y))
        return F.relu(y + self.proj(x_BCHW))


class ResNetTiny(nn.Module):
    """``widths`` channels per stage; input ``[B, 3, H, W]``, logits ``[B, K]``."""

    def __init__(self, num_classes: int, widths: tuple[int, ...] = (16, 32, 64)) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.GroupNorm(GROUPS, widths[0]),
                                  nn.ReLU())
        blocks, c = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(BasicBlock(c, w, stride=1 if i == 0 else 2))
            c = w
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x_BCHW))
        return self.head(h.mean(dim=(2, 3)))

    @staticmethod
    def loss(logits_BK: torch.Tensor, labels_B: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits_BK, labels_B)


def build_cnn(num_classes: int, seed: int, dtype: torch.dtype | None = None) -> ResNetTiny:
    """The model initialized from ``seed`` alone (PyTorch's default initialization under a
    seeded generator), so every rank and layout starts from the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ResNetTiny(num_classes)
    return model.to(dtype or torch.get_default_dtype())
