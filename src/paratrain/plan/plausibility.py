"""Is a predicted MFU supported by what anyone has measured? Published MFU records per device, and the
planner's warning when a prediction exceeds the best of them for a model of similar size.

Records:

- Megatron-LM (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models"; the table in the Megatron-LM README): GPT models on A100 with selective recomputation and
  sequence parallelism, data-parallel size 1 — MFU 41.5 % (22B), 51.4 % (175B), 56.0 % (530B), 56.3 %
  (1T); explicit attention kernels (no FlashAttention);
- Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM"): GPT-3 175B on 1,024 A100 at 138 TFLOP/s per GPU, "44 % of peak" — but their FLOP
  count (appendix, ``96·B·s·l·h²·(1 + s/6h + V/16lh)``) includes the recomputed forward of full
  activation recomputation, so that 44 % is hardware FLOPs utilisation; in model FLOPs (``72·…·(1 +
  s/6h + V/12lh)``, no recomputation; s 2,048, h 12,288, l 96, V 51,200) it is 138 × 0.7507 =
  103.6 TFLOP/s, MFU 33.2 %;
- MegaScale (Jiang et al., NSDI'24, table 2): the Megatron-LM baseline (commit 285068c8) on GPT-3 175B
  (vocabulary 64,000), tp 8, pp 8, interleaved with 6 chunks per rank, on 256–12,288 Ampere GPUs:
  MFU 53.0 % (256 GPUs), 49.9 % (512), 46.7 % (768), 44.7 % (1,024) at batch 768 and 48.7 % (3,072),
  47.8 % (6,144), 43.3 % (8,192), 41.2 % (12,288) at batch 6,144; the attention kernels are not stated.
  MegaScale's own figures (up to 65.3 %) are left out: they train another model (parallel transformer
  block, sliding-window attention, LAMB at 3x the batch);
- every bf16 row of the public-runs table (``paratrain/data/publicruns``), its MFU computed here
  from the published tokens/s with paratrain's model FLOPs (the MFU convention: full attention
  square, no recomputation) over the dense bf16 peak (A100 312 TFLOP/s, H100 989.5 TFLOP/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from paratrain.cost.dp_reduction import default_skew_cv, skew_s
from paratrain.spec.cluster import ClusterSpec
from paratrain.spec.model import ModelSpec

__all__ = ["MfuRecord", "PUBLISHED", "records", "best_measured", "nearest_scale", "device_family",
           "plausibility_warnings"]

_SIZE_WINDOW = 2.5  # records of models within 2.5x of the planned model's size count as "that size"
# A prediction within the cost model's accuracy target (5 %) of the record is supported by it.
_TOLERANCE = 1.05


@dataclass(frozen=True)
class MfuRecord:
    device: str  # a100 | h100
    model: str
    params_b: float
    gpus: int | None
    mfu: float
    attention: str  # flash | math: what the run used (unstated: not published)
    source: str


_MEGATRON = "Megatron-LM README / Korthikanti et al. 2022 (selective recomputation, sequence parallel, dp 1)"
PUBLISHED = (
    MfuRecord("a100", "GPT 22B", 22.0, None, 0.415, "math", _MEGATRON),
    MfuRecord("a100", "GPT-3 175B", 175.0, None, 0.514, "math", _MEGATRON),
    MfuRecord("a100", "GPT 530B", 530.0, None, 0.560, "math", _MEGATRON),
    MfuRecord("a100", "GPT 1T", 1000.0, None, 0.563, "math", _MEGATRON),
    MfuRecord("a100", "GPT-3 175B", 175.0, 1024, 0.332, "math",
              "Narayanan et al. 2021, 138 TFLOP/s per GPU with recomputation counted (44 % HFU)"),
    *(MfuRecord("a100", "GPT-3 175B", 175.0, gpus, mfu, "unstated",
                f"MegaScale (Jiang et al. 2024) table 2, Megatron-LM on {gpus:,} GPUs, batch {batch}")
      for gpus, batch, mfu in ((256, 768, 0.530), (512, 768, 0.499), (768, 768, 0.467), (1024, 768, 0.447),
                               (3072, 6144, 0.487), (6144, 6144, 0.478), (8192, 6144, 0.433),
                               (12288, 6144, 0.412))),
)
_PEAK = {"a100": 312e12, "h100": 989.5e12}


def _family(device: str) -> str:
    """``a100`` / ``h100`` for a public-runs device key (``h100-hbm2e`` is an H100)."""
    return next(f for f in _PEAK if device.startswith(f))


def device_family(cluster: ClusterSpec) -> str | None:
    name = cluster.device.name
    for fam in _PEAK:
        if name.startswith(fam):
            return fam
    return None


@lru_cache(maxsize=1)
def records() -> tuple[MfuRecord, ...]:
    """:data:`PUBLISHED` and the public-runs table's bf16 rows."""
    from paratrain.cost.flops import model_flops_per_iteration
    from paratrain.data import DATA_DIR
    from paratrain.plan.publicruns import parse_public_runs, run_model

    path = DATA_DIR / "publicruns" / "h100_a100_public_runs.csv"
    out = list(PUBLISHED)
    for r in parse_public_runs(path.read_text(encoding="utf-8"), path.name).runs:
        if r.gemm_dtype is not None:  # FP8 rows: their MFU over the bf16 peak is no bf16 record
            continue
        model = run_model(r)
        flops = model_flops_per_iteration(model, r.global_batch)
        mfu = flops / (r.time_s * r.gpus * _PEAK[_family(r.device)])
        out.append(MfuRecord(_family(r.device), r.model_name, model.param_count() / 1e9, r.gpus, mfu, r.attention,
                             f"{r.source} (public-runs line {r.line})"))
    return tuple(out)


def best_measured(family: str, params_b: float) -> MfuRecord | None:
    """The highest MFU measured on ``family`` for a model within 2.5x of ``params_b`` parameters."""
    near = [r for r in records() if r.device == family and 1 / _SIZE_WINDOW <= r.params_b / params_b <= _SIZE_WINDOW]
    return max(near, key=lambda r: r.mfu, default=None)


def nearest_scale(family: str, params_b: float, gpus: int) -> MfuRecord | None:
    """The record on ``family`` for a model of that size whose GPU count is nearest ``gpus`` (by
    ratio), the best of those at that count."""
    near = [r for r in records() if r.device == family and r.gpus
            and 1 / _SIZE_WINDOW <= r.params_b / params_b <= _SIZE_WINDOW]
    if not near:
        return None
    dist = min(abs(math.log(r.gpus / gpus)) for r in near)
    return max((r for r in near if abs(math.log(r.gpus / gpus)) == dist), key=lambda r: r.mfu)


def plausibility_warnings(
    model: ModelSpec, cluster: ClusterSpec, *, mfu: float, bubble_fraction: float, exposed_comm_fraction: float,
    attention: str,
) -> list[str]:
    """Warnings when ``mfu`` exceeds the best measured on the device for a model of this size by more
    than 5 %, naming the parts of the prediction that produce it."""
    family = device_family(cluster)
    if family is None:
        return []
    params_b = model.param_count() / 1e9
    best = best_measured(family, params_b)
    if best is None or mfu <= best.mfu * _TOLERANCE:
        return []
    dev = cluster.device
    busy = max(1e-9, 1.0 - bubble_fraction - exposed_comm_fraction)
    parts = [
        f"compute alone would run at {100 * mfu / busy:.0f}% of peak (GEMM efficiency {dev.gemm_efficiency:.2f}"
        f" before shape effects; {attention} attention"
        + (f" at {dev.attention_efficiency:.2f} of peak" if attention == "flash" else "")
        + ")",
        f"idle {100 * bubble_fraction:.1f}% (pipeline bubble and waits)",
        f"exposed communication {100 * exposed_comm_fraction:.1f}% of the iteration",
    ]
    ranks = cluster.num_devices
    cv = default_skew_cv(dev)
    if cv > 0 and ranks > 1:
        wait = skew_s(busy, ranks, cv)  # as a fraction of the iteration: busy is one
        parts.append(f"of the idle time, the wait for the slowest of {ranks:,} ranks about {100 * wait:.1f}% "
                     f"({100 * cv:.0f}% per-rank spread, cost.dp_reduction)")
    msg = (
        f"predicted MFU {100 * mfu:.1f}% exceeds the best measured on {family.upper()} for a model of "
        f"{params_b:.0f}B (±{_SIZE_WINDOW}x): {100 * best.mfu:.1f}% ({best.model}, {best.source}). "
        f"Where it comes from: {'; '.join(parts)}."
    )
    scale = nearest_scale(family, params_b, ranks)
    if scale is not None and scale != best:
        msg += (f" At {scale.gpus:,} GPUs the records show {100 * scale.mfu:.1f}% ({scale.model}, {scale.source}):"
                " what the model leaves out grows with the scale.")
    if attention == "flash" and best.attention == "math":
        msg += " The record ran explicit attention kernels; --attention math models that."
    return [msg]
