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

__all__ = ["TrainConfig", "DP_IMPLS", "TASKS", "check_outputs", "check_host_memory", "check_world_size",
           "check_context_parallel", "check_model_layout", "check_task", "check_compression", "check_checkpointing",
           "check_eval", "check_sinks", "DEFAULT_EVAL_BATCHES", "OPTIMIZERS", "check_kfac", "check_sharding",
           "default_dp_impl", "train_refusal", "dropout_notice"]

DP_IMPLS = ("paratrain", "ddp", "fsdp")
TASKS = ("gpt", "image")  # image: the CNN on an image folder (runtime/data/image_task.py)
INITS = ("random", "pretrained")  # pretrained: a HF model directory's weights (runtime/models/hf.py)
OPTIMIZERS = ("adamw", "kfac", "sgd")  # kfac: runtime/kfac.py (K-FAC preconditioning, SGD with momentum)
DEFAULT_EVAL_BATCHES = 4  # global batches per evaluation when --eval-batches is not given
MAX_LOADER_WORKERS = 64  # DataLoader worker processes per training process


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
    # dense steps before gradient compression starts (ParallelConfig.compression); Ok-Topk's code
    # warms up 512 calls on ImageNet-sized runs, a few steps suffice for the tiny models here
    compress_warmup: int = 5
    # Deep Gradient Compression's corrections (runtime/compress/momentum.py, Lin et al. ICLR'18):
    # momentum before compression (with --optimizer sgd), its factor masking, and the 25 % -> density
    # ramp over this many compressed steps (0: none)
    compress_momentum_correction: bool = False
    compress_momentum_masking: bool = True
    compress_density_warmup: int = 0
    # error feedback in units of the update (compress/momentum.py, ResidualLrScaling): each step
    # rescales the sparse compressors' residuals by lr_prev / lr, so an entry sent late is applied
    # at the learning rates of the steps that produced it, not at the current one
    compress_lr_weighted_residual: bool = True
    task: str = "gpt"
    loader_workers: int = 0  # DataLoader worker processes of the image task (0: in the training process)
    # checkpointing (runtime/checkpoint, CheckFreq): where, how often ('auto', 'N' steps, 'Ns'
    # seconds), how many complete checkpoints to keep (0: all), whether to resume from the newest
    checkpoint_dir: str | None = None
    checkpoint_every: str = "auto"
    keep: int = 2  # the newest and one to fall back on when the newest fails verification
    resume: bool = False
    checkpoint_overhead: float = 0.035  # auto's bound on checkpointing's share of step time (issue 13)
    # optimizer (runtime/kfac.py for kfac): damping λ of each Kronecker factor, steps per curvature
    # cycle; kfac_filled: the bubble-filled schedule (schedule.filled.FilledSchedule as JSON text,
    # from `train --fill-bubbles`), step t runs its iteration t % kfac_refresh
    optimizer: str = "adamw"
    kfac_damping: float = 1e-3  # kfac-pytorch's default
    kfac_refresh: int = 1
    kfac_filled: str | None = None
    # tokenized text (runtime/data/tokenized.py): a tokenizer.json directory; --data is then a token
    # cache or text files tokenized into one
    tokenizer: str | None = None
    # evaluation (runtime/eval.py): data, every N steps (None: after the last step only), K batches
    eval_data: str | None = None
    eval_every: int | None = None
    eval_batches: int | None = None  # None: DEFAULT_EVAL_BATCHES
    # logging sinks (runtime/sinks.py), rank 0 only
    tensorboard: str | None = None
    wandb: bool = False
    wandb_project: str = "paratrain"
    wandb_run: str | None = None
    # initial weights: random (from the seed) or pretrained (the HF model directory init_from,
    # loaded by runtime/models/hf.py into the full model before cutting and sharding)
    init: str = "random"
    init_from: str | None = None
    # communication layer (runtime/comm): every call's row to this JSON-lines file; a tuning table
    # (paratrain comm tune) choosing the backend per (op, size, group size)
    comm_log: str | None = None
    comm_table: str | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError("--steps", f"must be at least 1, got {self.steps}", "use --steps 1 or more")
        if self.init not in INITS:
            raise ConfigError("--init", f"unknown value {self.init!r}", f"use one of: {', '.join(INITS)}")
        if self.init == "pretrained" and self.init_from is None:
            raise ConfigError("--init", "pretrained needs a HF model directory as --model",
                              "give --model DIR (config.json + *.safetensors) or use --init random")
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
        if isinstance(self.compress_warmup, bool) or not isinstance(self.compress_warmup, int) \
                or self.compress_warmup < 0:
            raise ConfigError("--compress-warmup", f"must be an integer of at least 0, got {self.compress_warmup!r}",
                              "use e.g. --compress-warmup 5 (dense steps before compression)")
        if isinstance(self.compress_density_warmup, bool) or not isinstance(self.compress_density_warmup, int) \
                or self.compress_density_warmup < 0:
            raise ConfigError("--compress-density-warmup", f"must be an integer of at least 0, got "
                              f"{self.compress_density_warmup!r}", "use e.g. --compress-density-warmup 20 (0: none)")
        if self.compress_momentum_correction and self.optimizer != "sgd":
            raise ConfigError("--compress-momentum-correction", f"moves SGD's momentum before the compression; "
                              f"--optimizer {self.optimizer} has no such momentum", "add --optimizer sgd")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError("--timeout", f"must be a positive finite number of seconds, got {self.timeout_s}",
                              "use e.g. --timeout 60")
        require_positive("weight_decay", self.weight_decay, allow_zero=True)
        require_positive("min_lr_ratio", self.min_lr_ratio, allow_zero=True)
        if self.task not in TASKS:
            raise ConfigError("--task", f"unknown value {self.task!r}", f"use one of: {', '.join(TASKS)}")
        # Each worker is a process per training rank: an absurd count would fork until the machine stalls.
        if not 0 <= self.loader_workers <= MAX_LOADER_WORKERS:
            raise ConfigError("--loader-workers", f"must be in 0..{MAX_LOADER_WORKERS}, got {self.loader_workers}",
                              "use e.g. --loader-workers 2 (0: load in the training process)")
        self._check_checkpointing()
        self._check_optimizer()
        self._check_eval()

    def _check_eval(self) -> None:
        for flag, value in (("--eval-every", self.eval_every), ("--eval-batches", self.eval_batches)):
            if value is None:
                continue
            if self.eval_data is None:
                raise ConfigError(flag, "needs --eval-data (the text to evaluate on)",
                                  "add --eval-data FILE_OR_CACHE, or drop " + flag)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(flag, f"must be an integer of at least 1, got {value!r}", f"use e.g. {flag} 10")
        if self.eval_data is not None and not os.path.exists(self.eval_data):
            raise ConfigError("--eval-data", f"{self.eval_data!r} does not exist", "give a text file, directory or "
                              "token cache (paratrain data prepare)")
        if self.tokenizer is not None and self.data in ("stdlib", "synthetic"):
            raise ConfigError("--tokenizer", f"tokenizes text files, not --data {self.data}",
                              "give --data FILES or a token cache with --tokenizer")

    @property
    def num_eval_batches(self) -> int:
        return self.eval_batches if self.eval_batches is not None else DEFAULT_EVAL_BATCHES

    def _check_optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("--optimizer", f"unknown value {self.optimizer!r}",
                              f"use one of: {', '.join(OPTIMIZERS)}")
        if not (math.isfinite(self.kfac_damping) and self.kfac_damping > 0):
            raise ConfigError("--kfac-damping", f"must be a positive finite number, got {self.kfac_damping}",
                              "use e.g. --kfac-damping 1e-3")
        if isinstance(self.kfac_refresh, bool) or not isinstance(self.kfac_refresh, int) or self.kfac_refresh < 1:
            raise ConfigError("--kfac-refresh", f"must be an integer of at least 1, got {self.kfac_refresh!r}",
                              "use e.g. --kfac-refresh 10 (curvature and inverses every 10 steps)")
        if self.optimizer == "sgd" and self.checkpoint_dir is not None:
            raise ConfigError("--optimizer", "SGD's momentum is not in checkpoints (they hold AdamW's moments)",
                              "drop --checkpoint-dir with --optimizer sgd")
        if self.optimizer != "kfac" and (self.kfac_filled is not None or self.kfac_refresh != 1):
            raise ConfigError("--optimizer", f"K-FAC options were given with --optimizer {self.optimizer}",
                              "add --optimizer kfac, or drop --kfac-refresh/--fill-bubbles")

    def _check_checkpointing(self) -> None:
        from paratrain.runtime.checkpoint.frequency import parse_every

        parse_every(self.checkpoint_every)
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 0:
            raise ConfigError("--keep", f"must be an integer of at least 0, got {self.keep!r}",
                              "use e.g. --keep 2 (0: keep every checkpoint)")
        if not (math.isfinite(self.checkpoint_overhead) and 0 < self.checkpoint_overhead < 1):
            raise ConfigError("--checkpoint-overhead", f"must be a fraction in (0, 1), got {self.checkpoint_overhead}",
                              "use e.g. --checkpoint-overhead 0.035 (3.5% of step time)")
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError("--resume", "needs --checkpoint-dir (where to find the checkpoints)",
                              "add --checkpoint-dir DIR, the directory the earlier run wrote")

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 10)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_eval(config: ParallelConfig, train: TrainConfig) -> None:
    """Evaluation (runtime/eval.py) runs at step boundaries of the language-model task."""
    if train.eval_data is None:
        return
    if train.task != "gpt":
        raise ConfigError("--eval-data", f"evaluation covers --task gpt, not --task {train.task}",
                          "drop --eval-data with --task image")


def check_sinks(train: TrainConfig) -> None:
    """The logging sinks' packages are installed and their directory can be written."""
    import importlib.util

    if train.tensorboard is not None:
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("--tensorboard", "needs the tensorboard package",
                              "pip install tensorboard (or pip install 'paratrain[tensorboard]')")
        check_output_path(os.path.join(train.tensorboard, "events"), "--tensorboard")
    if train.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("--wandb", "needs the wandb package", "pip install wandb (or pip install 'paratrain[wandb]')")


def check_task(config: ParallelConfig, train: TrainConfig) -> None:
    """The image task runs data parallelism only, on a directory of images."""
    if train.task != "image":
        return
    if config.tp > 1 or config.pp > 1:
        raise ConfigError("--task", f"image runs data parallelism only, got tp={config.tp} pp={config.pp}",
                          "use --tp 1 --pp 1 with --task image (scale with --dp)")
    if train.data in ("stdlib", "synthetic") or not os.path.isdir(train.data):
        raise ConfigError("--data", f"--task image reads a directory of images, got {train.data!r}",
                          "write one with `paratrain data generate --items 512 --out DIR`, then --data DIR")


def check_kfac(config: ParallelConfig, train: TrainConfig) -> None:
    """The layouts K-FAC runs with (runtime/kfac.py): whole nn.Linear layers on each rank (no tensor
    parallelism or FSDP shards), synchronous steps, the language-model task."""
    if train.optimizer == "sgd" and config.pp > 1 and config.schedule.is_async:
        raise ConfigError("--optimizer sgd", f"{config.schedule.value} re-ties the shared embedding's AdamW "
                          "moments at each drain", "use --optimizer adamw, or a synchronous --schedule")
    if train.optimizer != "kfac":
        return
    where = "--optimizer kfac"
    if config.tp > 1:
        raise ConfigError(where, f"preconditions whole linear layers; tensor parallelism (tp={config.tp}) shards "
                          "them", "use --tp 1 with --optimizer kfac (scale with --dp and --pp)")
    if train.dp_impl == "fsdp" or config.optimizer_sharding:
        raise ConfigError(where, "preconditions whole linear layers; FSDP2 shards them",
                          "use --dp-impl paratrain (or ddp) with --optimizer kfac")
    if config.pp > 1 and config.schedule.is_async:
        raise ConfigError(where, f"takes curvature at step boundaries; {config.schedule.value} updates stages "
                          "asynchronously", "use a synchronous --schedule (gpipe, 1f1b, interleaved, chimera, ...)")
    if config.compression != "none":
        raise ConfigError(where, f"is not combined with gradient compression ({config.compression})",
                          "use --compress none with --optimizer kfac")
    if train.task != "gpt":
        raise ConfigError(where, f"preconditions the language models' linear layers, not --task {train.task}",
                          "use --task gpt with --optimizer kfac")
    if train.checkpoint_dir is not None:
        raise ConfigError(where, "K-FAC's factors and momentum are not in checkpoints yet",
                          "drop --checkpoint-dir with --optimizer kfac")
    if train.kfac_filled is not None and config.pp < 2:
        raise ConfigError("--fill-bubbles", f"fills pipeline bubbles and needs --pp > 1, got pp={config.pp}",
                          "add --pp 2 (or more), or drop --fill-bubbles")


def check_compression(config: ParallelConfig, train: TrainConfig) -> None:
    """The layouts gradient compression runs with (paratrain.runtime.compress): paratrain's own
    reduction (the library DDP and FSDP2 paths reduce inside torch), any tp, pp and cp; gTop-k
    pairs ranks, so its reduction group (dp x cp ranks) must be a power of two."""
    name = config.compression
    dgc = train.compress_momentum_correction or train.compress_density_warmup
    replicas = config.dp * config.cp  # the reduction group
    if dgc and (name in ("none", "powersgd") or replicas < 2):
        flag = "--compress-momentum-correction" if train.compress_momentum_correction else "--compress-density-warmup"
        raise ConfigError(flag, f"applies to a sparse compressor's data-parallel reduction, not to --compress {name} "
                          f"with dp({config.dp})", "use --compress oktopk (topka, gtopk, gaussiank) and --dp 2 or more")
    if name == "none":
        return
    if train.dp_impl != "paratrain":
        raise ConfigError("--compress", f"{name} runs in paratrain's gradient reduction, not in {train.dp_impl} "
                          "(torch reduces those gradients itself)", "use --dp-impl paratrain or --compress none")
    if name == "gtopk" and replicas & (replicas - 1):
        what = f"dp({config.dp})" + (f" x cp({config.cp})" if config.cp > 1 else "")
        raise ConfigError("--compress", f"gtopk pairs ranks by recursive doubling and needs a power-of-two dp, "
                          f"got {what}", "use --dp 2, 4, 8, ... or another compressor")
    if config.pp > 1 and config.schedule.is_async:
        raise ConfigError("--compress", f"{name} keeps one residual per synchronous step; {config.schedule.value} "
                          "updates stages asynchronously", "use a synchronous --schedule (gpipe, 1f1b, ...)")


def check_outputs(train: TrainConfig) -> None:
    """Every output path can be written (a typo costs a second, not a training run)."""
    if train.metrics is not None:
        check_output_path(train.metrics.replace("{rank}", "0"), "--metrics")
    if train.trace is not None:
        check_output_path(train.trace, "--trace")
    if train.comm_log is not None:
        check_output_path(train.comm_log, "--comm-log")
    if train.comm_table is not None:  # a malformed table or an unknown backend stops the run here
        from paratrain.runtime.comm.table import load_table

        load_table(train.comm_table)
    if train.save_final is not None:
        check_output_path(train.save_final, "--save-final")
    if train.checkpoint_dir is not None:
        from paratrain.runtime.checkpoint import store

        if train.resume:  # the newest complete checkpoint exists and verifies (checksums), before torch loads
            store.resume_checkpoint(train.checkpoint_dir)
        else:
            store.check_fresh_dir(train.checkpoint_dir)


def default_dp_impl(config: ParallelConfig) -> str:
    """What ``train`` runs a layout's data parallelism with when ``--dp-impl`` is not given: FSDP2
    for zero2 / zero3, paratrain's own reduction (and distributed optimizer for zero1) otherwise."""
    return "fsdp" if config.sharding in ("zero2", "zero3") else "paratrain"


def dropout_notice(model: ModelSpec) -> str | None:
    """The line ``paratrain train`` prints when the model asks for dropout (``dropout: true``,
    e.g. a HF GPT-2 config's ``resid_pdrop``), which the runtime's models do not run; None otherwise
    (unset dropout is the cost model's family default and says nothing about the run)."""
    if model.dropout:
        return ("note: the model sets dropout, which paratrain train does not run (its layers have no "
                "dropout); the cost model's predictions of this run need --no-dropout or dropout: false")
    return None


def train_refusal(model: ModelSpec, config: ParallelConfig) -> str | None:
    """The one-line error ``paratrain train --config`` would stop with on this layout under its
    default options (before any process starts), or None when it runs it. For ``plan``: a layout
    the cost model prices is not always one the runtime runs."""
    train = TrainConfig(dp_impl=default_dp_impl(config))
    try:
        check_model_layout(model, config)
        check_context_parallel(config, train)
        check_tp_overlap(config)
        check_gemm_dtype(config)
        check_sharding(config, train)
        check_compression(config, train)
    except ConfigError as e:
        return str(e)
    return None


def check_tp_overlap(config: ParallelConfig) -> None:
    """The runtime issues DTensor's collectives unfused: overlapping them with their GEMMs (torch's
    async TP needs torch.compile's micro-pipeline pass and CUDA symmetric memory; Transformer
    Engine's userbuffers need NVLink) is what the cost model prices, not what ``train`` runs."""
    if config.tp_overlap != "none":
        raise ConfigError("--tp-overlap", f"paratrain train does not run {config.tp_overlap} tensor-parallel overlap "
                          "(its DTensor collectives run unfused)",
                          'plan without --tp-overlap, or set "tp_overlap": "none" in the run document')


def check_gemm_dtype(config: ParallelConfig) -> None:
    """The runtime's linear layers run in the training dtype: FP8 GEMMs (and their weight cache) are
    priced by the cost model, not run by ``train``, which would otherwise train a layout other than
    the one planned without a word."""
    if config.gemm_dtype is not None:
        raise ConfigError("gemm_dtype", f"paratrain train does not run {config.gemm_dtype} linear layers (its GEMMs "
                          "run in the training dtype)",
                          'plan without --gemm-dtype, or remove "gemm_dtype" (and "fp8_weight_cache") from the run '
                          "document")


def check_sharding(config: ParallelConfig, train: TrainConfig) -> None:
    """Which data-parallel implementation runs each ``--sharding`` level: zero1 is paratrain's
    distributed optimizer (runtime/zero.py), zero2 / zero3 are FSDP2 (``--dp-impl fsdp``); each with
    the pipeline schedules whose backward and optimizer steps go through their mechanism."""
    if config.sharding == "zero1":
        if train.dp_impl != "paratrain":
            raise ConfigError("--dp-impl", f"{train.dp_impl} does not run --sharding zero1 (paratrain's distributed "
                              "optimizer does)", "use --dp-impl paratrain (the default) with --sharding zero1")
        for flag, used, what in (("--compress", config.compression != "none", "gradient compression"),
                                 ("--optimizer", train.optimizer == "kfac", "K-FAC"),
                                 ("--task", train.task != "gpt", "the image task")):
            if used and config.dp > 1:
                raise ConfigError(flag, f"{what} is not wired into --sharding zero1 (the sharded optimizer state)",
                                  "use --sharding none, or zero2/zero3 with --dp-impl fsdp")
    elif config.sharding != "none" and train.dp_impl != "fsdp":
        raise ConfigError("--dp-impl", f"{train.dp_impl} does not shard (--sharding {config.sharding})",
                          "use --dp-impl fsdp")
    if train.dp_impl == "fsdp" and config.pp > 1 and config.schedule.is_async:
        # FSDP2's parameters are the shards it gathers, not the weight versions these schedules stash
        raise ConfigError("--schedule", f"{config.schedule} does not run under FSDP2 (--dp-impl fsdp): its "
                          "weight versions bypass FSDP's gathered parameters",
                          "use gpipe, 1f1b, interleaved, zb-h1 or chimera with --dp-impl fsdp")


def check_checkpointing(config: ParallelConfig, train: TrainConfig) -> None:
    """The image task's trainer is not covered yet. (Asynchronous pipelines, PipeDream and 2BW,
    drain at each checkpoint step: runtime/pipeline.py.)"""
    if train.checkpoint_dir is not None and train.task != "gpt":
        raise ConfigError("--checkpoint-dir", f"checkpointing covers --task gpt, not --task {train.task}",
                          "drop --checkpoint-dir with --task image")


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_memory(spec: ModelSpec, procs_on_host: int, config: ParallelConfig | None = None) -> None:
    """Reject a run this machine cannot hold before any process allocates it: every process
    builds the full fp32 model (4 bytes a parameter) before keeping its share, and the ranks
    together hold fp32 gradients and AdamW's two moments (12 bytes a parameter). With the run's
    ``config``, each process also holds at least one micro-batch's activations of its stage's
    layers (the cost model's per-layer bytes with fused attention, the smallest of its kinds): a
    sequence or micro-batch far beyond the machine is refused here rather than swapping."""
    params = spec.param_count()
    need = params * (4 * procs_on_host + 12)
    limit = _available_memory_bytes()
    if need > limit:
        raise ConfigError(
            "model size", f"{spec.name} has {params:,} parameters (layers {spec.layers}, hidden {spec.hidden}, "
            f"vocab {spec.vocab}): ~{need / 1e9:,.1f} GB of weights, gradients and AdamW state on this machine "
            f"({procs_on_host} process(es)), more than the {limit / 1e9:,.1f} GB of memory available",
            "use smaller --layers, --hidden or --vocab, or fewer processes per machine")
    if config is None:
        return
    from paratrain.cost.memory import activation_bytes_per_layer

    layers = -(-spec.layers // config.pp)
    acts = layers * activation_bytes_per_layer(
        spec, microbatch=config.microbatch, tp=config.tp, sequence_parallel=config.sequence_parallel,
        recompute=config.recompute, dtype=config.dtype, attention="flash")
    if need + procs_on_host * acts > limit:
        raise ConfigError(
            "--seq/--microbatch", f"one micro-batch of {config.microbatch} x {spec.seq} tokens holds "
            f"~{acts / 1e9:,.1f} GB of activations per process ({layers} layer(s)); with the model's "
            f"{need / 1e9:,.1f} GB, {procs_on_host} process(es) need more than the {limit / 1e9:,.1f} GB of "
            "memory available", "use a smaller --microbatch or --seq")


def check_context_parallel(config: ParallelConfig, train: TrainConfig) -> None:
    """What the runtime's ring attention (runtime/context_parallel.py) does not run with: the image
    task (a CNN has no sequence). Every other layout runs (GPT, Llama and BERT; dp, tp with or
    without sequence parallelism, pipelines, every sharding level, compression and K-FAC over dp x cp)."""
    if config.cp > 1 and train.task != "gpt":
        raise ConfigError("--task", f"the {train.task} task has no sequence to split (cp {config.cp})",
                          "drop --cp with --task image, or use --cp 1")


def check_world_size(config: ParallelConfig, world_size: int) -> None:
    if config.world_size != world_size:
        raise ConfigError(
            "world size",
            f"{config.degrees_text}={config.world_size} != world_size({world_size})",
            f"launch {config.world_size} processes (--nproc {config.world_size}) or change --dp/--tp/--pp/--cp",
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
