"""The run options of ``paratrain train`` that are neither the model nor the parallel layout, and
the checks of a run that need no torch (so a bad flag costs a second, not torch's import)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from paratrain.errors import ConfigError, require_positive
from paratrain.fileio import check_output_path
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.model import ModelSpec

__all__ = ["TrainConfig", "DP_IMPLS", "check_outputs", "check_host_memory", "check_world_size", "check_model_layout"]

DP_IMPLS = ("paratrain", "ddp", "fsdp")


@dataclass(frozen=True)
class TrainConfig:
    """Everything about a run that is not the model or the parallel layout.

    Checked on construction, so bad values stop ``paratrain train`` before any worker starts.
    """

    steps: int = 20
    seed: int = 0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio (Chinchilla, Hoffmann et al. 2022)
    warmup_steps: int | None = None  # None: 10% of the steps
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)  # GPT-3 (Brown et al. 2020, appendix B)
    grad_clip: float = 1.0  # inf: no clipping
    bf16: bool = False
    data: str = "stdlib"
    data_cap_bytes: int = 8 * 2**20
    dp_impl: str = "paratrain"
    bucket_bytes: int = 25 * 2**20
    metrics: str | None = None
    trace: str | None = None
    save_final: str | None = None
    timeout_s: float = 300.0
    log_every: int = 1
    progress: bool = True
    # pipeline receives posted ahead per peer (runtime.pipeline_engine); None: 2 on gloo, 0 on NCCL
    prefetch_receives: int | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError("--steps", f"must be at least 1, got {self.steps}", "use --steps 1 or more")
        if self.dp_impl not in DP_IMPLS:
            raise ConfigError("--dp-impl", f"unknown value {self.dp_impl!r}", f"use one of: {', '.join(DP_IMPLS)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError("--lr", f"must be a positive finite number, got {self.lr}", "use e.g. --lr 1e-3")
        if math.isnan(self.grad_clip) or not self.grad_clip > 0:
            raise ConfigError("--grad-clip", f"must be positive, got {self.grad_clip}",
                              "use e.g. --grad-clip 1.0 (inf: no clipping)")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError("--warmup", f"must be at least 0, got {self.warmup_steps}",
                              "use e.g. --warmup 0 (none) or leave it out (10% of --steps)")
        if self.log_every < 1:
            raise ConfigError("--log-every", f"must be at least 1, got {self.log_every}", "use e.g. --log-every 10")
        if self.bucket_bytes < 1:
            raise ConfigError("--bucket-mb", f"must be positive, got {self.bucket_bytes / 2**20:g}", "use e.g. 25")
        if self.prefetch_receives is not None and self.prefetch_receives < 0:
            raise ConfigError("--prefetch-receives", f"must be at least 0, got {self.prefetch_receives}",
                              "use 0 (post each receive at its action) or 1-2")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError("--timeout", f"must be a positive finite number of seconds, got {self.timeout_s}",
                              "use e.g. --timeout 60")
        require_positive("weight_decay", self.weight_decay, allow_zero=True)
        require_positive("min_lr_ratio", self.min_lr_ratio, allow_zero=True)

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 10)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_outputs(train: TrainConfig) -> None:
    """Every output path can be written (a typo costs a second, not a training run)."""
    if train.metrics is not None:
        check_output_path(train.metrics.replace("{rank}", "0"), "--metrics")
    if train.trace is not None:
        check_output_path(train.trace, "--trace")
    if train.save_final is not None:
        check_output_path(train.save_final, "--save-final")


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_memory(spec: ModelSpec, procs_on_host: int) -> None:
    """Reject a model this machine cannot hold before any process allocates it: every process
    builds the full fp32 model (4 bytes a parameter) before keeping its share, and the ranks
    together hold fp32 gradients and AdamW's two moments (12 bytes a parameter)."""
    params = spec.param_count()
    need = params * (4 * procs_on_host + 12)
    limit = _available_memory_bytes()
    if need > limit:
        raise ConfigError(
            "model size", f"{spec.name} has {params:,} parameters (layers {spec.layers}, hidden {spec.hidden}, "
            f"vocab {spec.vocab}): ~{need / 1e9:,.1f} GB of weights, gradients and AdamW state on this machine "
            f"({procs_on_host} process(es)), more than the {limit / 1e9:,.1f} GB of memory available",
            "use smaller --layers, --hidden or --vocab, or fewer processes per machine")


def check_world_size(config: ParallelConfig, world_size: int) -> None:
    if config.world_size != world_size:
        raise ConfigError(
            "world size",
            f"dp({config.dp})*tp({config.tp})*pp({config.pp})={config.world_size} != world_size({world_size})",
            f"launch {config.world_size} processes (--nproc {config.world_size}) or change --dp/--tp/--pp",
        )


def check_model_layout(model: ModelSpec, config: ParallelConfig) -> None:
    """The layout checks of ``ParallelConfig.validate_for`` plus what this runtime's TP needs."""
    config.validate_for(model, even_layers=config.partition is None)
    if config.tp > 1:
        if model.num_kv_heads % config.tp:
            raise ConfigError(
                "tp", f"tp({config.tp}) does not divide the {model.num_kv_heads} key/value heads",
                "the runtime shards whole key/value heads: use tp dividing kv_heads",
            )
        if model.vocab % config.tp:
            raise ConfigError(
                "tp", f"tp({config.tp}) does not divide the vocabulary {model.vocab} (vocabulary-parallel embedding)",
                f"use --vocab {model.vocab + (-model.vocab) % config.tp} or a tp dividing {model.vocab}",
            )
