"""Real training on torch.distributed: mesh, reference models, tensor/data/pipeline parallelism.

Entry points: ``paratrain train`` (CLI), :func:`run_training` (Python), and for a new executor the
step loop :class:`~paratrain.runtime.train.Trainer` and :class:`~paratrain.runtime.executor.StepExecutor`.
Importing this package does not import torch; the names below load on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_training", "TrainConfig", "TrainResult"]


def __getattr__(name: str) -> Any:
    if name in ("run_training", "TrainResult"):
        from . import launch

        return getattr(launch, name)
    if name == "TrainConfig":
        from .config import TrainConfig

        return TrainConfig
    raise AttributeError(name)
