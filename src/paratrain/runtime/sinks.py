"""Where the metrics rows go besides the JSON lines: TensorBoard (``--tensorboard DIR``) and
Weights & Biases (``--wandb``), both on rank 0 only.

Each row's numbers are logged at its ``step`` under the tags of :data:`TAGS` (TensorBoard groups
tags by the part before ``/``); rows without a key (no evaluation this step) log nothing for it.

wandb runs offline unless ``WANDB_MODE`` says otherwise: the run is written under ``WANDB_DIR``
(default ``./wandb``) with no network or account, and ``wandb sync DIR`` uploads it later.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from paratrain.errors import ConfigError

from .config import TrainConfig

__all__ = ["TAGS", "Sink", "TensorBoardSink", "WandbSink", "open_sinks", "scalars"]

# metrics row key -> TensorBoard tag
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "samples_per_s": "perf/samples_per_s",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    "max_memory_bytes": "perf/max_memory_bytes",
    "tokens": "train/tokens",
    "eval_loss": "eval/loss",
    "eval_ppl": "eval/ppl",
}


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's logged numbers by tag."""
    return {tag: float(row[key]) for key, tag in TAGS.items()
            if isinstance(row.get(key), int | float) and not isinstance(row.get(key), bool)}


class Sink(Protocol):
    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """torch's SummaryWriter: one event file under ``logdir``."""

    def __init__(self, logdir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("--tensorboard", "needs the tensorboard package",
                              "pip install tensorboard (or pip install 'paratrain[tensorboard]')") from None
        self.writer = SummaryWriter(log_dir=logdir)

    def write(self, row: dict[str, Any]) -> None:
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, global_step=int(row["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run (offline unless ``WANDB_MODE`` is set), history keyed by the same tags."""

    def __init__(self, project: str, name: str | None, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("--wandb", "needs the wandb package",
                              "pip install wandb (or pip install 'paratrain[wandb]')") from None
        self.run = wandb.init(project=project, name=name, config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"))  # type: ignore[arg-type]

    def write(self, row: dict[str, Any]) -> None:
        self.run.log(scalars(row), step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


def open_sinks(train: TrainConfig, rank: int, run_config: dict[str, Any] | None = None) -> list[Sink]:
    """The sinks ``train`` asks for, on rank 0 (an empty list elsewhere)."""
    if rank != 0:
        return []
    sinks: list[Sink] = []
    if train.tensorboard is not None:
        sinks.append(TensorBoardSink(train.tensorboard))
    if train.wandb:
        sinks.append(WandbSink(train.wandb_project, train.wandb_run, run_config or train.to_dict()))
    return sinks
