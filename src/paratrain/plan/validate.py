"""Predicted vs measured iteration time, and the fit of the efficiency parameters.

Measured data: the vTrain ground truth (Megatron-DeepSpeed on A100, shipped in
``paratrain/data/vtrain/``, see its README): full activation recomputation, 1F1B, 8 GPUs per node, no
gradient bucketing (so the data-parallel all-reduce does not overlap the backward), CSV columns
in the order TP, **DP**, PP. Each row becomes a GPT model, a cluster and a
:class:`ParallelConfig`, and the predicted iteration time comes from the simulator (or the
closed forms, which agree with it to the rounding on 1F1B).

This module parses text and computes; reading files and plotting stay in the CLI.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig, Recompute, ScheduleName
from paratrain.spec.cluster import ClusterSpec, LinkSpec
from paratrain.spec.model import ModelSpec

__all__ = [
    "MeasuredRun",
    "Calibration",
    "parse_vtrain_csv",
    "run_model",
    "run_config",
    "vtrain_cluster",
    "predict",
    "megatron_predictor",
    "errors_pct",
    "fit",
    "fit_links",
    "parse_allreduce_lut",
    "with_calibration",
    "summary",
    "FIT_PARAMETERS",
]

_GPT2_VOCAB = 50257  # GPT-2 BPE, what Megatron-DeepSpeed's GPT runs tokenize with
_MAKE_VOCAB_DIVISIBLE_BY = 128  # Megatron-LM pads the vocabulary to a multiple of 128 × tp

# Header fragments (lower case) → field; the multi-node file has an extra "Parameters" column.
_COLUMNS = {
    "# gpus": "gpus",
    "global batch": "global_batch",
    "micro batch": "microbatch",
    "hidden size": "hidden",
    "attention heads": "heads",
    "# layers": "layers",
    "sequence length": "seq",
    "tensor parallelism": "tp",
    "data parallelism": "dp",
    "pipeline parallelism": "pp",
    "iteration time (ms)": "time_ms",
}


@dataclass(frozen=True)
class MeasuredRun:
    """One measured run: the model shape, the layout and its iteration time."""

    gpus: int
    global_batch: int
    microbatch: int
    hidden: int
    heads: int
    layers: int
    seq: int
    tp: int
    dp: int
    pp: int
    time_s: float
    line: int  # line in the CSV file (1 = header)


@dataclass(frozen=True)
class Calibration:
    """Efficiency parameters fitted to measurements.

    ``intra_bandwidth_Bps``/``intra_latency_s`` are the alpha–beta of the intra-node link as
    nccl-tests all-reduce timings show it (fitted by :func:`fit_links`); the same bandwidth
    efficiency (fitted / nominal) is applied to the inter-node links. The device's
    ``gemm_efficiency``, ``memory_efficiency`` and ``host_issue_s`` (host time to issue one kernel,
    overlapping the device's work) are fitted to measured iterations by :func:`fit`;
    ``kernel_overhead_s`` (the device-side cost of each kernel) stays the preset's.
    """

    gemm_efficiency: float
    memory_efficiency: float
    kernel_overhead_s: float
    intra_bandwidth_Bps: float
    intra_latency_s: float
    link_efficiency: float
    host_issue_s: float = 0.0
    attention_efficiency: float | None = None  # fused attention's fraction of peak; None: the device's

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


FIT_PARAMETERS = ("gemm_efficiency", "memory_efficiency", "host_issue_s")
_BOUNDS = {
    "gemm_efficiency": (0.3, 1.0),
    "memory_efficiency": (0.2, 1.0),
    "host_issue_s": (0.0, 200e-6),
}


def parse_vtrain_csv(text: str, source: str = "DATA.csv") -> list[MeasuredRun]:
    """Rows of a vTrain ground-truth CSV (UTF-8, with or without a byte-order mark)."""
    text = text.lstrip("\ufeff")
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        raise ConfigError(source, "is empty", "give a vTrain ground-truth CSV") from None
    index: dict[str, int] = {}
    for i, name in enumerate(header):
        key = _COLUMNS.get(name.strip().lower())
        if key is not None:
            index[key] = i
    missing = [c for c in _COLUMNS.values() if c not in index]
    if missing:
        raise ConfigError(
            source,
            f"has no column for {missing[0]!r} (header: {', '.join(header)})",
            "use the vTrain CSV format: # GPUs, global batch, micro batch, ..., iteration time (ms)",
        )
    runs = []
    seen: dict[tuple[object, ...], int] = {}
    for lineno, row in enumerate(reader, start=2):
        if not row or all(not x.strip() for x in row):
            continue
        where = f"{source} line {lineno}"
        if len(row) != len(header):  # a missing or extra comma shifts every later column
            raise ConfigError(where, f"has {len(row)} fields, the header {len(header)}", "fix or remove the line")
        vals = {k: row[i].strip() for k, i in index.items()}
        try:
            floats = {k: float(v) for k, v in vals.items()}
        except ValueError:
            k = next(k for k, v in vals.items() if not _is_float(v))
            raise ConfigError(where, f"{k} is {vals[k]!r}, not a number", "fix or remove the line") from None
        bad = [k for k, v in floats.items() if not math.isfinite(v)]
        if bad:
            raise ConfigError(where, f"{bad[0]} is {vals[bad[0]]!r}, not a finite number", "fix or remove the line")
        frac = [k for k, v in floats.items() if k != "time_ms" and v != int(v)]
        if frac:
            raise ConfigError(where, f"{frac[0]} is {vals[frac[0]]!r}, not a whole number", "fix or remove the line")
        ints = {k: int(v) for k, v in floats.items() if k != "time_ms"}
        t = floats["time_ms"] / 1e3
        if t <= 0 or min(ints.values()) <= 0:
            raise ConfigError(where, "has a non-positive value", "fix or remove the line")
        if ints["tp"] * ints["dp"] * ints["pp"] != ints["gpus"]:
            raise ConfigError(
                where,
                f"tp*dp*pp = {ints['tp'] * ints['dp'] * ints['pp']} is not the {ints['gpus']} GPUs",
                "check the column order (TP, DP, PP)",
            )
        key = (*sorted(ints.items()), t)
        if key in seen:  # a pasted line twice weighs one run double in every statistic
            raise ConfigError(where, f"repeats line {seen[key]} (same layout and time)",
                              "remove the copy (repeated measurements differ in their time)")
        seen[key] = lineno
        run = MeasuredRun(time_s=t, line=lineno, **ints)
        try:  # the run's model and layout are checked here, so a bad row names its line
            run_model(run)
            run_config(run)
        except ConfigError as e:
            raise ConfigError(where, f"{e.field}: {e.problem}", e.fix) from None
        runs.append(run)
    if not runs:
        raise ConfigError(source, "has no data rows", "give a vTrain ground-truth CSV")
    return runs


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def run_model(run: MeasuredRun) -> ModelSpec:
    """The GPT of a run; the vocabulary padded as Megatron-LM pads it for the run's tp."""
    mult = _MAKE_VOCAB_DIVISIBLE_BY * run.tp
    vocab = -(-_GPT2_VOCAB // mult) * mult
    return ModelSpec(
        name=f"gpt-h{run.hidden}-l{run.layers}",
        layers=run.layers,
        hidden=run.hidden,
        heads=run.heads,
        seq=run.seq,
        vocab=vocab,
        dtype="fp16",
    )


def run_config(run: MeasuredRun) -> ParallelConfig:
    """Megatron-DeepSpeed's layout for the run: tp inside a node, full recomputation, 1F1B, and its
    explicit attention kernels (vTrain's runs use Megatron's fused softmax, not FlashAttention)."""
    return ParallelConfig(
        dp=run.dp,
        tp=run.tp,
        pp=run.pp,
        microbatch=run.microbatch,
        global_batch=run.global_batch,
        schedule=ScheduleName.ONE_F_ONE_B,
        recompute=Recompute.FULL,
        dtype="fp16",
        attention="math",
    )


def vtrain_cluster(base: ClusterSpec, gpus: int, calibration: Calibration | None = None) -> ClusterSpec:
    """``base`` sized to ``gpus`` with vTrain's inter-node bandwidth (800 Gb/s per 8-GPU node,
    vTrain's validation configs) and, if given, the calibrated efficiencies."""
    inter = LinkSpec(bandwidth_Bps=800e9 / 8 / base.devices_per_node, latency_s=base.inter_link.latency_s)
    cluster = dataclasses.replace(base, inter_link=inter).resized(gpus=gpus)
    if calibration is None:
        return cluster
    return with_calibration(cluster, calibration)


def with_calibration(cluster: ClusterSpec, calibration: Calibration) -> ClusterSpec:
    """``cluster`` with the calibrated device efficiencies and link parameters."""
    dev = dataclasses.replace(
        cluster.device,
        gemm_efficiency=calibration.gemm_efficiency,
        memory_efficiency=calibration.memory_efficiency,
        kernel_overhead_s=calibration.kernel_overhead_s,
        host_issue_s=calibration.host_issue_s,
        attention_efficiency=(
            cluster.device.attention_efficiency if calibration.attention_efficiency is None
            else calibration.attention_efficiency
        ),
    )
    inter = cluster.inter_link
    return dataclasses.replace(
        cluster,
        device=dev,
        intra_link=LinkSpec(bandwidth_Bps=calibration.intra_bandwidth_Bps, latency_s=calibration.intra_latency_s),
        inter_link=dataclasses.replace(inter, bandwidth_Bps=inter.bandwidth_Bps * calibration.link_efficiency),
    )


def parse_allreduce_lut(text: str, ranks: int, source: str = "LUT") -> list[tuple[int, float, float]]:
    """(ranks, bytes, seconds) from an nccl-tests style all-reduce table (vTrain's AR_GPU*_LUT:
    size(B), count, type, time(ns), busbw, ...; the out-of-place time is used)."""
    rows = list(csv.reader(io.StringIO(text.lstrip("\ufeff"))))
    out = []
    for lineno, row in enumerate(rows[1:], start=2):
        if not row:
            continue
        try:
            out.append((ranks, int(row[0]), float(row[3]) * 1e-9))
        except (ValueError, IndexError):
            raise ConfigError(f"{source} line {lineno}", f"cannot read {row!r}", "give an nccl-tests table") from None
    return out


def fit_links(
    samples: Sequence[tuple[int, int, float]], base: ClusterSpec, collective: Callable[..., Any]
) -> tuple[float, float]:
    """Fit the intra-node link's bandwidth and latency so that ``collective("all_reduce", ...)``
    on ranks 0..n-1 of one node reproduces measured all-reduce times (log-space least squares)."""
    from scipy.optimize import least_squares

    node = base.resized(nodes=1)

    def residuals(x: Sequence[float]) -> list[float]:
        c = dataclasses.replace(node, intra_link=LinkSpec(bandwidth_Bps=x[0] * 1e9, latency_s=x[1] * 1e-6))
        return [math.log(collective("all_reduce", nbytes, tuple(range(n)), c).time_s / t) for n, nbytes, t in samples]

    x0 = [base.intra_link.bandwidth_Bps / 1e9, max(base.intra_link.latency_s * 1e6, 1.0)]
    res = least_squares(residuals, x0, bounds=([1.0, 0.0], [1e4, 1e3]))
    return float(res.x[0] * 1e9), float(res.x[1] * 1e-6)


Predictor = Callable[[ModelSpec, ClusterSpec, ParallelConfig], float]


def megatron_predictor(engine: str) -> Predictor:
    """Iteration time of a Megatron-DeepSpeed run as vTrain measured them, by the simulator
    (``"sim"``) or the closed forms (``"analytic"``).

    Two settings of those runs differ from the planner's defaults: the data-parallel all-reduce
    follows the backward (no gradient bucketing, ``use_gradient_bucket: false`` in vTrain's
    configs), and the element-wise operators are Megatron-LM's fused kernels
    (scale-mask-softmax, bias-GeLU, bias-dropout-add), which its argument parser enables unless
    ``--no-masked-softmax-fusion``/``--no-bias-gelu-fusion``/``--no-bias-dropout-fusion`` is given.
    """
    import functools

    from paratrain.cost.stage import chunk_costs

    costs = functools.partial(chunk_costs, fused=True)
    if engine == "sim":
        from paratrain.schedule.registry import generate
        from paratrain.sim.report import simulate, timing_for_config

        def sim(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig) -> float:
            config.validate_for(model)
            schedule = generate(
                config.schedule.value,
                stages=config.pp,
                microbatches=config.num_microbatches,
                virtual_stages=config.virtual_stages,
            )
            timing = timing_for_config(schedule, costs(model, cluster, config), cluster, config)
            return simulate(schedule, timing, overlap_grad_reduce=False, record=False).iteration_time_s

        return sim
    if engine == "analytic":
        from paratrain.plan.backend import default_backend
        from paratrain.plan.search import evaluate

        def analytic(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig) -> float:
            backend = dataclasses.replace(default_backend(), chunk_costs=costs)
            return evaluate(model, cluster, config, backend, 1.0, overlap_grad_reduce=False).analytic.iteration_time_s

        return analytic
    raise ConfigError("--engine", f"unknown engine {engine!r}", "use sim or analytic")


def predict(
    runs: Sequence[MeasuredRun],
    base: ClusterSpec,
    calibration: Calibration | None,
    predictor: Predictor,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> list[float]:
    """Predicted iteration time of every run (seconds); ``progress(done, total)`` after each."""
    clusters: dict[int, ClusterSpec] = {}
    out = []
    for r in runs:
        if r.gpus not in clusters:
            try:
                clusters[r.gpus] = vtrain_cluster(base, r.gpus, calibration)
            except ConfigError as e:
                raise ConfigError(f"line {r.line}", f"{e.field}: {e.problem}", e.fix) from None
        out.append(predictor(run_model(r), clusters[r.gpus], run_config(r)))
        if progress is not None:
            progress(len(out), len(runs))
    return out


def errors_pct(runs: Sequence[MeasuredRun], predicted: Sequence[float]) -> list[float]:
    """Signed error of each prediction, percent of the measured time."""
    return [100.0 * (p / r.time_s - 1.0) for r, p in zip(runs, predicted, strict=True)]


def summary(errors: Sequence[float]) -> dict[str, float]:
    a = [abs(e) for e in errors]
    a_sorted = sorted(a)
    return {
        "rows": len(a),
        "mean_abs_error_pct": sum(a) / len(a),
        "median_abs_error_pct": a_sorted[len(a) // 2],
        "max_abs_error_pct": max(a),
        "mean_error_pct": sum(errors) / len(errors),
    }


def fit(
    runs: Sequence[MeasuredRun],
    base: ClusterSpec,
    predictor: Predictor,
    *,
    start: Calibration,
    max_evaluations: int = 60,
) -> tuple[Calibration, dict[str, Any]]:
    """Least-squares fit of the device's :data:`FIT_PARAMETERS` to ``runs`` (log of predicted /
    measured, soft-L1 loss so a few odd runs do not dominate); the link parameters of ``start``
    stay fixed. Returns the calibration and the optimizer's report."""
    from scipy.optimize import least_squares

    names = FIT_PARAMETERS
    scale = [1.0, 1.0, 1e-5]  # the issue time is in seconds: fit it in units of 10 µs

    def unpack(x: Sequence[float]) -> Calibration:
        return dataclasses.replace(start, **{n: float(v) * s for n, v, s in zip(names, x, scale, strict=True)})

    def residuals(x: Sequence[float]) -> list[float]:
        pred = predict(runs, base, unpack(x), predictor)
        return [math.log(p / r.time_s) for r, p in zip(runs, pred, strict=True)]

    x0 = [getattr(start, n) / s for n, s in zip(names, scale, strict=True)]
    lo = [_BOUNDS[n][0] / s for n, s in zip(names, scale, strict=True)]
    hi = [_BOUNDS[n][1] / s for n, s in zip(names, scale, strict=True)]
    res = least_squares(
        residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.05, max_nfev=max_evaluations, diff_step=0.02
    )
    return unpack(res.x), {"evaluations": int(res.nfev), "cost": float(res.cost), "status": int(res.status)}
