"""Published end-to-end training throughputs on A100 and H100 (``paratrain/data/publicruns/``), and
their predicted step times.

Each row of the table (its README lists the sources and conventions) is one published run: a model
shape, a GPU count and type, a layout (tp, pp, dp, cp), micro and global batch, recomputation,
attention kernels, the data-parallel implementation, and the tokens per second per GPU. The
measured step time is ``global_batch · seq / (gpus · tokens_per_s_per_gpu)``.

How a row becomes a prediction:

- **model**: Llama (RMSNorm, SwiGLU, rotary, untied, no biases), MPT (LayerNorm without biases,
  GELU, ALiBi — no position parameters, no dropout —, tied), GPT-3 (LayerNorm, GELU, learned
  positions, tied, biases), bf16;
- **cluster**: ``dgx-a100`` or ``dgx-h100`` resized to the row's GPUs (the A100 rows that state
  their network have 1,600 Gb/s per node, the DGX A100's 8 × 200 Gb/s; torchtitan's H100s have
  400 Gb/s per GPU, the DGX H100's);
- **data parallelism**: FSDP (FULL_SHARD, FSDP2) and SHARD_GRAD_OP through
  :func:`paratrain.cost.sharding.fsdp_microbatch_s`, gradients reduced in fp32 (torchtitan's
  ``mixed_precision_reduce`` default, Composer's ``DEFAULT`` mixed precision; ``PURE`` reduces in
  bf16); DDP / ZeRO-1 all-reduce the gradients during the last micro-batch's backward
  (``no_sync`` before), ZeRO-1 then all-gathers the updated parameters;
- **recomputation**: ``full`` recomputes each block's forward; ``selective (per-layer)`` is
  torchtitan's checkpointing of every second block; ``selective``/``selective (per-op)`` is
  torchtitan's per-op policy, which keeps the attention output and every second matmul's output and
  recomputes the rest (``torchtitan/.../parallelize_llama.py``, ``_save_list`` and the
  ``mm`` counter); Megatron's selective recomputation of the attention core is free with fused
  attention;
- **attention**: flash unless the row says the run had no FlashAttention (then ``math``).

Rows the model cannot take are skipped with the reason (:attr:`PublicRuns.skipped`): FP8 rows (the
FP8 GEMMs and their scaling kernels are not modelled), rows with an unknown micro-batch, context
parallelism (cp > 1) and pipelines under FSDP.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig, Recompute
from paratrain.spec.cluster import ClusterSpec
from paratrain.spec.model import Activation, ModelSpec, Norm, Position

__all__ = [
    "PublicRun",
    "PublicRuns",
    "parse_public_runs",
    "run_model",
    "run_config",
    "run_cluster",
    "predict_step_s",
    "predict",
    "SOURCE_NAMES",
]

# Source column prefix -> short name (one per published table or page).
SOURCE_NAMES = (
    ("torchtitan 2024-12", "torchtitan-h100-2024-12"),
    ("torchtitan 2025-06", "torchtitan-asynctp-2025-06"),
    ("torchtitan 2024-08", "torchtitan-405b-2024-08"),
    ("torchtitan 2024-04", "torchtitan-a100-2024-04"),
    ("NeMo AutoModel", "nemo-automodel"),
    ("NeMo 24.07", "nemo-24.07"),
    ("Megatron-Bridge", "megatron-bridge-25.11"),
    ('"Llama 3 Herd', "llama3-paper"),
    ("Llama 3 Herd", "llama3-paper"),
    ("FlashAttention-2 paper", "flashattention2-paper"),
    ("flash-attention training README", "flash-attention-readme"),
    ("MosaicML llm-foundry", "mpt-llm-foundry"),
)

_REQUIRED = (
    "source", "model", "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "seq", "vocab", "gpus", "gpu_type",
    "precision", "tp", "pp", "dp", "cp", "microbatch", "global_batch", "activation_recompute", "flash_attention",
    "other_opts", "tokens_per_s_per_gpu", "notes",
)
_GPT3_HEADS_DEFAULT = 32  # GPT-3 2.7B (Brown et al. 2020, table 2.1): 32 heads of 80; the table leaves it open
_FSDP_REDUCE_BYTES = 4  # gradients reduce-scattered in fp32 (module docstring)


@dataclass(frozen=True)
class PublicRun:
    """One published run, as the cost model takes it."""

    source: str
    model_name: str
    device: str  # a100 | h100
    gpus: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    vocab: int
    tp: int
    pp: int
    dp: int
    microbatch: int
    global_batch: int
    recompute: str  # none | selective-op | selective-layer | full
    attention: str  # flash | math
    sharding: str  # fsdp | zero2 | zero1 | ddp
    reduce_bytes: int  # bytes per gradient element in the reduce-scatter
    sequence_parallel: bool
    fused: bool  # element-wise kernels fused (torch.compile, or the run's own fused kernels)
    family: str  # llama | mpt | gpt3
    tag: str  # A | B | C: the table's reliability tag
    tokens_per_s_per_gpu: float
    line: int

    @property
    def time_s(self) -> float:
        """Measured step time."""
        return self.global_batch * self.seq / (self.gpus * self.tokens_per_s_per_gpu)


@dataclass(frozen=True)
class PublicRuns:
    runs: tuple[PublicRun, ...]
    skipped: tuple[tuple[int, str, str], ...]  # (line, source, reason)


def _source_name(text: str) -> str:
    for prefix, name in SOURCE_NAMES:
        if text.startswith(prefix):
            return name
    words = re.findall(r"[A-Za-z0-9.]+", text)[:3]
    return "-".join(w.lower() for w in words) or "unknown"


def _int(row: dict[str, str], key: str, where: str) -> int:
    text = row[key].strip().replace(",", "")
    try:
        v = int(text)
    except ValueError:
        raise ConfigError(where, f"{key} is {row[key]!r}, not a whole number", "fix or skip the row") from None
    if v <= 0:
        raise ConfigError(where, f"{key} is {v}, not positive", "fix or skip the row")
    return v


def _recompute(text: str) -> str:
    t = text.strip().lower()
    if t in ("none", "no", "unknown", ""):
        return "none"
    if t.startswith("full"):
        return "full"
    if "per-layer" in t:
        return "selective-layer"
    if t.startswith("selective"):
        return "selective-op"
    raise ConfigError("activation_recompute", f"unknown recomputation {text!r}",
                      "use none, full, selective, selective (per-layer) or selective (per-op)")


def _sharding(opts: str) -> tuple[str, bool]:
    """(data-parallel implementation, gradients reduced in the 16-bit dtype)."""
    o = opts.lower()
    pure = "mode pure" in o
    if "shard_grad_op" in o:
        return "zero2", pure
    if "fsdp" in o or "full_shard" in o:
        return "fsdp", pure
    if "zero-1" in o or "zero1" in o:
        return "zero1", pure
    return "ddp", pure


def _fused(opts: str) -> bool:
    """torch.compile fuses the element-wise kernels; the flash-attention repository's runs use its
    fused MLP / dropout-add-LayerNorm kernels."""
    o = opts.lower().replace("no torch.compile", "")
    return "torch.compile" in o or "fused" in o or "flashattention-2" in o


def _device(gpu_type: str) -> str | None:
    g = gpu_type.lower()
    if g.startswith("a100"):
        return "a100"
    if g.startswith("h100"):
        return "h100"
    return None


def parse_public_runs(text: str, source: str = "DATA.csv") -> PublicRuns:
    """Rows of the public-runs table the model takes, and the skipped ones with their reason."""
    reader = csv.DictReader(io.StringIO(text.lstrip("\ufeff")))
    missing = [c for c in _REQUIRED if c not in (reader.fieldnames or [])]
    if missing:
        raise ConfigError(source, f"has no column {missing[0]!r}", "use the public-runs table format (its README)")
    runs: list[PublicRun] = []
    skipped: list[tuple[int, str, str]] = []
    for line, row in enumerate(reader, start=2):
        where = f"{source} line {line}"
        src = _source_name(row["source"])

        def skip(reason: str, line: int = line, src: str = src) -> None:
            skipped.append((line, src, reason))

        if row["precision"].strip().lower() != "bf16":
            skip(f"{row['precision']} (FP8 GEMMs are not modelled)")
            continue
        device = _device(row["gpu_type"])
        if device is None:
            skip(f"GPU {row['gpu_type']!r} has no preset")
            continue
        if not row["microbatch"].strip().isdigit():
            skip("micro-batch not published")
            continue
        if row["cp"].strip() not in ("1", ""):
            skip(f"context parallelism cp={row['cp']} (not modelled)")
            continue
        tp, pp, dp = _int(row, "tp", where), _int(row, "pp", where), _int(row, "dp", where)
        sharding, pure = _sharding(row["other_opts"])
        if pp > 1 and sharding in ("fsdp", "zero2"):
            skip("pipeline under FSDP (not modelled)")
            continue
        gpus = _int(row, "gpus", where)
        if tp * pp * dp != gpus:
            raise ConfigError(where, f"tp*pp*dp = {tp * pp * dp} is not the {gpus} GPUs", "fix the layout columns")
        heads_text = row["heads"].strip()
        heads = int(heads_text) if heads_text.isdigit() else _GPT3_HEADS_DEFAULT
        kv_text = row["kv_heads"].strip()
        kv = int(kv_text) if kv_text.isdigit() else heads
        name = row["model"].strip()
        family = "llama" if name.lower().startswith("llama") else "mpt" if name.lower().startswith("mpt") else "gpt3"
        attention = "math" if row["flash_attention"].strip().lower().startswith("no") else "flash"
        tag_match = re.match(r"\[([ABC])", row["notes"].strip())
        try:
            tps = float(row["tokens_per_s_per_gpu"].replace(",", ""))
        except ValueError:
            raise ConfigError(where, f"tokens_per_s_per_gpu is {row['tokens_per_s_per_gpu']!r}",
                              "give a number") from None
        if not (math.isfinite(tps) and tps > 0):
            raise ConfigError(where, f"tokens_per_s_per_gpu is {tps}", "give a positive number")
        run = PublicRun(
            source=src, model_name=name, device=device, gpus=gpus, layers=_int(row, "layers", where),
            hidden=_int(row, "hidden", where), heads=heads, kv_heads=kv, ffn=_int(row, "ffn_hidden", where),
            seq=_int(row, "seq", where), vocab=_int(row, "vocab", where), tp=tp, pp=pp, dp=dp,
            microbatch=_int(row, "microbatch", where), global_batch=_int(row, "global_batch", where),
            recompute=_recompute(row["activation_recompute"]), attention=attention, sharding=sharding,
            reduce_bytes=2 if pure else _FSDP_REDUCE_BYTES, sequence_parallel=tp > 1, fused=_fused(row["other_opts"]),
            family=family,
            tag=tag_match.group(1) if tag_match else "C", tokens_per_s_per_gpu=tps, line=line,
        )
        try:
            run_config(run).validate_for(run_model(run))
        except ConfigError as e:
            raise ConfigError(where, f"{e.field}: {e.problem}", e.fix) from None
        runs.append(run)
    if not runs:
        raise ConfigError(source, "has no row the cost model takes", "give bf16 rows on A100 or H100")
    return PublicRuns(tuple(runs), tuple(skipped))


def run_model(run: PublicRun) -> ModelSpec:
    common = dict(layers=run.layers, hidden=run.hidden, heads=run.heads, kv_heads=run.kv_heads, ffn=run.ffn,
                  seq=run.seq, vocab=run.vocab, name=run.model_name, dtype="bf16")
    if run.family == "llama":
        return ModelSpec(**common, norm=Norm.RMSNORM, activation=Activation.SWIGLU, position=Position.ROTARY,
                         tied_embeddings=False, bias=False)
    if run.family == "mpt":  # ALiBi: no position parameters (modelled as rotary), no dropout
        return ModelSpec(**common, norm=Norm.LAYERNORM, activation=Activation.GELU, position=Position.ROTARY,
                         tied_embeddings=True, bias=False)
    return ModelSpec(**common)


def run_config(run: PublicRun) -> ParallelConfig:
    rc = Recompute.FULL if run.recompute == "full" else Recompute.NONE
    return ParallelConfig(
        dp=run.dp, tp=run.tp, pp=run.pp, microbatch=run.microbatch, global_batch=run.global_batch, recompute=rc,
        sequence_parallel=run.sequence_parallel, dtype="bf16", attention=run.attention,
    )


def run_cluster(run: PublicRun, clusters: dict[str, ClusterSpec]) -> ClusterSpec:
    """The run's cluster: ``clusters[run.device]`` resized to its GPUs."""
    return clusters[run.device].resized(gpus=run.gpus)


@lru_cache(maxsize=4096)
def _layer_split(
    model: ModelSpec, cluster: ClusterSpec, tp: int, sp: bool, mb: int, attention: str, fused: bool
) -> float:
    """Fraction of a layer's forward that torchtitan's per-op policy recomputes: the element-wise
    and norm kernels and every second matmul (the attention kernel's output is kept)."""
    from paratrain.cost.compute import layer_ops, op_time_split

    ops = layer_ops(model, tp=tp, sequence_parallel=sp, microbatch=mb, dtype="bf16", attention=attention, fused=fused)
    times = [(op, op_time_split(op, cluster.device, "bf16")[0]) for op in ops]
    total = sum(t for _, t in times)
    gemm = sum(t for op, t in times if op.gemm is not None)
    attn = sum(t for op, t in times if op.attention_shape is not None)
    return (0.5 * gemm + (total - gemm - attn)) / total if total else 0.0


def predict_step_s(run: PublicRun, cluster: ClusterSpec) -> float:
    """Predicted step time of ``run`` on ``cluster`` (already sized to its GPUs)."""
    from paratrain.cost.collectives import collective_time
    from paratrain.cost.optimizer import optimizer_step_s
    from paratrain.cost.sharding import ShardedUnit, fsdp_microbatch_s
    from paratrain.cost.stage import chunk_costs

    model, config = run_model(run), run_config(run)
    if config.pp > 1:
        return _pipeline_step_s(model, cluster, config)
    (whole,) = chunk_costs(model, cluster, config, fused=run.fused)
    less = dataclasses.replace(model, layers=model.layers - 1)
    (fewer,) = chunk_costs(less, cluster, config, fused=run.fused)
    per = {f: getattr(whole, f) - getattr(fewer, f) for f in
           ("forward_s", "backward_input_s", "backward_weight_s", "recompute_s", "weight_bytes")}
    ends = {f: getattr(whole, f) - model.layers * per[f] for f in per}
    layer_bwd = per["backward_input_s"] + per["backward_weight_s"] + per["recompute_s"]
    if run.recompute == "selective-op":
        layer_bwds = [layer_bwd + per["forward_s"] * _layer_split(
            model, cluster, config.tp, config.sequence_parallel, config.microbatch, run.attention, run.fused,
        )] * model.layers
    elif run.recompute == "selective-layer":
        layer_bwds = [layer_bwd + (per["forward_s"] if i % 2 == 0 else 0.0) for i in range(model.layers)]
    else:
        layer_bwds = [layer_bwd] * model.layers
    e = 2
    dp_ranks = config.group_ranks("dp")[0]
    emb_bytes = -(-model.vocab // config.tp) * model.hidden * e
    head_bytes = max(0.0, ends["weight_bytes"] - emb_bytes)

    def comm(kind: str, nbytes: float) -> float:
        return collective_time(kind, nbytes, dp_ranks, cluster).time_s if nbytes > 0 else 0.0

    ends_bwd = ends["backward_input_s"] + ends["backward_weight_s"] + ends["recompute_s"]
    grads = [emb_bytes, *([per["weight_bytes"]] * model.layers), head_bytes]
    computes = [(0.0, 0.0), *((per["forward_s"], b) for b in layer_bwds), (ends["forward_s"], ends_bwd)]
    nmb = config.num_microbatches
    sharded = run.sharding in ("fsdp", "zero2")
    if sharded:
        scale = run.reduce_bytes / e
        units = [ShardedUnit(f, b, comm("all_gather", g), comm("reduce_scatter", g * scale))
                 for (f, b), g in zip(computes, grads, strict=True)]
        mb_s, _ = fsdp_microbatch_s(units, reshard_after_forward=run.sharding == "fsdp")
        step = nmb * mb_s
    else:
        plain = sum(f + b for f, b in computes)
        units = [ShardedUnit(f, b, 0.0, comm("all_reduce", g)) for (f, b), g in zip(computes, grads, strict=True)]
        last, _ = fsdp_microbatch_s(units, reshard_after_forward=False)
        step = (nmb - 1) * plain + last
        if run.sharding == "zero1":
            step += comm("all_gather", sum(grads))
    shard = config.dp if sharded or run.sharding == "zero1" else 1
    params = whole.weight_bytes / e
    step += optimizer_step_s(whole.weight_bytes / (config.dp if sharded else 1), whole.grad_bytes / (
        config.dp if sharded else 1), params * 12 / shard, cluster.device)
    return step


def _pipeline_step_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig) -> float:
    from paratrain.cost.stage import chunk_costs
    from paratrain.schedule.registry import generate
    from paratrain.sim.report import simulate, timing_for_config

    schedule = generate(config.schedule.value, stages=config.pp, microbatches=config.num_microbatches,
                        virtual_stages=config.virtual_stages)
    timing = timing_for_config(schedule, chunk_costs(model, cluster, config), cluster, config)
    return simulate(schedule, timing, record=False).iteration_time_s


def predict(
    runs: Sequence[PublicRun], clusters: dict[str, ClusterSpec], progress: Callable[[int, int], None] | None = None
) -> list[float]:
    out = []
    for r in runs:
        out.append(predict_step_s(r, run_cluster(r, clusters)))
        if progress is not None:
            progress(len(out), len(runs))
    return out
