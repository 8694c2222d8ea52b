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
  400 Gb/s per GPU, the DGX H100's); torchtitan's 96 GB HBM2e, 500 W H100s get the
  ``h100-96gb-hbm2e`` device preset (device key ``h100-hbm2e``, :data:`DEVICE_CLUSTERS`), so each
  H100 part has its own calibration;
- **precision**: FP8 rows run the linear layers' GEMMs in FP8 (``ParallelConfig.gemm_dtype``):
  current scaling for torchao's Float8 and Megatron-Bridge's FP8-CS, delayed scaling for
  Transformer Engine's default recipe (NeMo, Composer's ``amp_fp8``); the Megatron-Core rows
  (NeMo, Megatron-Bridge) cast each FP8 weight once per step (:func:`_fp8_weight_cache`); Megatron
  rows keep their interleaved schedule (``virtual_stages``) and fused kernels, the Megatron-Core
  ones with their pipeline transfers overlapped (:func:`_overlap_p2p`);
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

Rows the model cannot take are skipped with the reason (:attr:`PublicRuns.skipped`): rows with an
unknown micro-batch. Context-parallel rows (cp > 1) are predicted with ring attention
(:mod:`paratrain.cost.context_parallel`), FSDP sharding over dp × cp.
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
    gemm_dtype: str | None = None  # None (the bf16 rows) | fp8 (current scaling) | fp8-delayed
    virtual_stages: int = 1  # > 1: Megatron's interleaved schedule
    cp: int = 1  # context parallelism (ring attention; cost.context_parallel)
    tp_overlap: str = "none"  # TP collectives overlapped with their GEMMs (cost.async_tp; _tp_overlap)
    fp8_weight_cache: bool = False  # FP8 weights cast once per step (Transformer Engine; _fp8_weight_cache)
    prefetch_receives: int | None = None  # pipeline receives posted ahead (_overlap_p2p)

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
    o = opts.lower().replace("fsdp=0", "")  # Megatron-Bridge's "DDP (FSDP=0)": no FSDP
    pure = "mode pure" in o
    if "shard_grad_op" in o or "no reshard after forw" in o:  # Llama 3's FSDP keeps parameters gathered
        return "zero2", pure
    if "fsdp" in o or "full_shard" in o:
        return "fsdp", pure
    if "zero-1" in o or "zero1" in o:
        return "zero1", pure
    return "ddp", pure


def _fused(opts: str) -> bool:
    """torch.compile fuses the element-wise kernels; the flash-attention repository's runs use its
    fused MLP / dropout-add-LayerNorm kernels; Megatron-Core runs its fused kernels (bias-GeLU,
    bias-dropout-add, Transformer Engine's fused norms and FP8 cast-transposes)."""
    o = opts.lower().replace("no torch.compile", "")
    return any(w in o for w in ("torch.compile", "fused", "flashattention-2", "megatron-core", "transformer engine"))


def _device(gpu_type: str) -> str | None:
    """``a100``, ``h100`` (the SXM5 80 GB part) or ``h100-hbm2e`` (torchtitan's Grand Teton parts,
    96 GB HBM2e at 500 W: the ``h100-96gb-hbm2e`` preset), the keys of :data:`DEVICE_PRESETS`."""
    g = gpu_type.lower()
    if g.startswith("a100"):
        return "a100"
    if g.startswith("h100"):
        return "h100-hbm2e" if "hbm2e" in g else "h100"
    return None


def _tp_overlap(source: str, family: str, opts: str, tp: int) -> str:
    """Whether the run overlapped its tensor-parallel collectives with their GEMMs (async TP,
    :mod:`paratrain.cost.async_tp`): torchtitan's async-TP rows say so ("async TP", "AsyncTP";
    "vanilla TP" rows do not); Megatron-Bridge's Llama recipes set ``CommOverlapConfig(tp_comm_overlap=True)``
    (``src/megatron/bridge/recipes/llama/llama3_70b.py`` and ``llama31_405b.py``); NeMo's GPT-3 175B
    launcher config sets ``ub_tp_comm_overlap: True`` (NeMo-Framework-Launcher
    ``launcher_scripts/conf/training/gpt3/175b.yaml``; its Llama 2 70B config leaves it off, and the
    NeMo rows' Llama configs are not pinned, so they keep the default, off)."""
    if tp < 2:
        return "none"
    if "asynctp" in opts.lower().replace(" ", "").replace("-", ""):
        return "async"
    nvidia = source == "megatron-bridge-25.11" or (source == "nemo-24.07" and family == "gpt3")
    return "userbuffers" if nvidia else "none"


def _fp8_scaling(opts: str) -> str:
    """torchao's Float8 (torchtitan; tensorwise dynamic scaling by default) and Megatron-Bridge's
    "FP8 current scaling" compute each scale from the tensor being cast (``fp8``); Transformer
    Engine's default recipe, which NeMo 24.07 and Composer's ``amp_fp8`` use, is delayed scaling
    (``fp8-delayed``)."""
    o = opts.lower()
    return "fp8" if "current scaling" in o or "float8" in o else "fp8-delayed"


def _fp8_weight_cache(opts: str, gemm_dtype: str | None) -> bool:
    """Whether the FP8 weights were cast once per step and cached for the step's other micro-batches
    (``ParallelConfig.fp8_weight_cache``): Megatron-Core's Transformer Engine modules pass TE its
    ``is_first_microbatch`` flag (``megatron/core/extensions/transformer_engine.py``: each module's
    forward hands ``self.is_first_microbatch`` to TE, then clears it; the schedules set it again at
    each step's start), so the NeMo and Megatron-Bridge rows cache. torchao's Float8 (torchtitan)
    has no such cache, and Composer calls TE's modules without the flag (MPT's FP8 row)."""
    return gemm_dtype is not None and "megatron-core" in opts.lower()


def _overlap_p2p(opts: str, virtual_stages: int) -> int | None:
    """Receives posted ahead per peer (``ParallelConfig.prefetch_receives``): Megatron-Core's
    interleaved schedule overlaps its pipeline transfers with the neighbouring chunk's compute
    (``overlap_p2p_comm``, on unless ``--no-overlap-p2p-communication``; the interleaved schedule
    only): each forward posts the next forward's receive and each backward the next backward's,
    waited for just before the compute that needs it, about one receive per peer ahead. Its
    warm-up and flush are overlapped only with ``--overlap-p2p-communication-warmup-flush``, which
    the rows do not name; here they are overlapped too. None: the backend's default (NCCL: none)."""
    return 1 if virtual_stages > 1 and "megatron-core" in opts.lower() else None


# Megatron pads the vocabulary to a multiple of 128 × tp (``--make-vocab-size-divisible-by``); the
# GPT-3 rows that leave the vocabulary open use GPT-2's BPE (50,257 tokens), as GPT-3 did (Brown et
# al. 2020, sec. 2.1).
_GPT2_VOCAB = 50257


def _padded_gpt2_vocab(tp: int) -> int:
    step = 128 * tp
    return -(-_GPT2_VOCAB // step) * step


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

        precision = row["precision"].strip().lower()
        if precision not in ("bf16", "fp8"):
            skip(f"precision {row['precision']} (not modelled)")
            continue
        gemm_dtype = _fp8_scaling(row["other_opts"]) if precision == "fp8" else None
        device = _device(row["gpu_type"])
        if device is None:
            skip(f"GPU {row['gpu_type']!r} has no preset")
            continue
        if not row["microbatch"].strip().isdigit():
            skip("micro-batch not published")
            continue
        tp, pp, dp = _int(row, "tp", where), _int(row, "pp", where), _int(row, "dp", where)
        cp = _int(row, "cp", where) if row["cp"].strip() else 1
        sharding, pure = _sharding(row["other_opts"])
        gpus = _int(row, "gpus", where)
        if tp * pp * dp * cp != gpus:
            raise ConfigError(where, f"tp*pp*dp*cp = {tp * pp * dp * cp} is not the {gpus} GPUs",
                              "fix the layout columns")
        heads_text = row["heads"].strip()
        heads = int(heads_text) if heads_text.isdigit() else _GPT3_HEADS_DEFAULT
        kv_text = row["kv_heads"].strip()
        kv = int(kv_text) if kv_text.isdigit() else heads
        name = row["model"].strip()
        family = "llama" if name.lower().startswith("llama") else "mpt" if name.lower().startswith("mpt") else "gpt3"
        attention = "math" if row["flash_attention"].strip().lower().startswith("no") else "flash"
        vs_text = (row.get("virtual_stages") or "").strip()
        vs = int(vs_text) if vs_text.isdigit() and pp > 1 else 1
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
            seq=_int(row, "seq", where), tp=tp, pp=pp, dp=dp, cp=cp,
            vocab=_int(row, "vocab", where) if row["vocab"].strip() or family != "gpt3" else _padded_gpt2_vocab(tp),
            gemm_dtype=gemm_dtype, virtual_stages=vs, tp_overlap=_tp_overlap(src, family, row["other_opts"], tp),
            fp8_weight_cache=_fp8_weight_cache(row["other_opts"], gemm_dtype),
            prefetch_receives=_overlap_p2p(row["other_opts"], vs),
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
    if run.family == "mpt":  # ALiBi (no position parameters, no rotary kernels), no dropout
        return ModelSpec(**common, norm=Norm.LAYERNORM, activation=Activation.GELU, position=Position.ALIBI,
                         tied_embeddings=True, bias=False)
    return ModelSpec(**common)


def run_config(run: PublicRun) -> ParallelConfig:
    """The run's layout. Pipelines under FSDP carry their sharding level: the simulator charges it
    in the chunk costs (:mod:`paratrain.cost.sharding`, FSDP inside each stage); without a
    pipeline :func:`predict_step_s` composes the FSDP units itself."""
    rc = Recompute.FULL if run.recompute == "full" else Recompute.NONE
    # (zero1 pipelines stay as they were modelled: Megatron's distributed optimizer, 12c's part)
    level = {"fsdp": "zero3", "zero2": "zero2"}.get(run.sharding, "none") if run.pp > 1 else "none"
    return ParallelConfig(
        sharding=level,
        dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, microbatch=run.microbatch, global_batch=run.global_batch,
        recompute=rc,
        sequence_parallel=run.sequence_parallel, dtype="bf16", attention=run.attention, gemm_dtype=run.gemm_dtype,
        schedule="interleaved" if run.virtual_stages > 1 else "1f1b", virtual_stages=run.virtual_stages,
        tp_overlap=run.tp_overlap, fp8_weight_cache=run.fp8_weight_cache, prefetch_receives=run.prefetch_receives,
    )


# The clusters the rows run on, by PublicRun.device: (cluster preset, device preset).
DEVICE_CLUSTERS = {
    "a100": ("dgx-a100", "a100-80gb"),
    "h100": ("dgx-h100", "h100"),
    "h100-hbm2e": ("dgx-h100", "h100-96gb-hbm2e"),
}


def public_clusters() -> dict[str, ClusterSpec]:
    """One cluster per device key of the rows: the DGX presets, the H100 HBM2e parts on the DGX H100's
    network (torchtitan's Grand Teton: 400 Gb/s per GPU, as the DGX H100)."""
    from paratrain.spec.cluster import resolve_cluster
    from paratrain.spec.device import resolve_device

    out = {}
    for key, (cluster, device) in DEVICE_CLUSTERS.items():
        c = resolve_cluster(cluster)
        out[key] = c if c.device.name == device else dataclasses.replace(c, device=resolve_device(device))
    return out


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
    from paratrain.cost.dp_reduction import OVERLAP_SLOWDOWN, skew_s
    from paratrain.cost.optimizer import optimizer_step_s
    from paratrain.cost.sharding import ShardedUnit, fsdp_microbatch_s
    from paratrain.cost.stage import chunk_costs

    model, config = run_model(run), run_config(run)
    if config.pp > 1:
        return _pipeline_step_s(model, cluster, config, run.fused)
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
    # Parameters are replicated over cp: FSDP / DDP shard and reduce over dp × cp (torchtitan's
    # dp_shard_cp mesh, Megatron's dp-cp group).
    dp_ranks = tuple(config.rank_of(dp=d, cp=k) for d in range(config.dp) for k in range(config.cp))
    n_shard = config.dp * config.cp
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
        mb_s, _ = fsdp_microbatch_s(units, reshard_after_forward=run.sharding == "fsdp", slowdown=OVERLAP_SLOWDOWN)
        step = nmb * mb_s
    else:
        plain = sum(f + b for f, b in computes)
        units = [ShardedUnit(f, b, 0.0, comm("all_reduce", g * run.reduce_bytes / e))
                 for (f, b), g in zip(computes, grads, strict=True)]
        last, _ = fsdp_microbatch_s(units, reshard_after_forward=False, slowdown=OVERLAP_SLOWDOWN)
        step = (nmb - 1) * plain + last
        if run.sharding == "zero1":
            step += comm("all_gather", sum(grads))
    # Every rank waits at the step's synchronisation for the slowest (cost.dp_reduction.skew_s).
    step += skew_s(nmb * sum(f + b for f, b in computes), run.gpus)
    shard = n_shard if sharded or run.sharding == "zero1" else 1
    params = whole.weight_bytes / e
    step += optimizer_step_s(whole.weight_bytes / (n_shard if sharded else 1), whole.grad_bytes / (
        n_shard if sharded else 1), params * 12 / shard, cluster.device)
    return step


def _pipeline_step_s(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, fused: bool) -> float:
    from paratrain.cost.stage import chunk_costs
    from paratrain.schedule.registry import generate
    from paratrain.sim.report import simulate, timing_for_config

    schedule = generate(config.schedule.value, stages=config.pp, microbatches=config.num_microbatches,
                        virtual_stages=config.virtual_stages)
    timing = timing_for_config(schedule, chunk_costs(model, cluster, config, fused=fused), cluster, config)
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
