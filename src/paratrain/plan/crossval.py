"""Per-device calibration fitted on measured runs of several sources, checked by leave-one-source-out
cross validation.

A *sample* is one measured run: a vTrain row (Megatron-DeepSpeed on A100, predicted by
:func:`paratrain.plan.validate.megatron_predictor`), a public-runs row
(:mod:`paratrain.plan.publicruns`), or one layer timed on the GPU itself (:class:`MeasuredLayer`,
predicted by :func:`paratrain.cost.stage.layer_cost`): the device without a framework's step. The
calibration of a device is five physically meaningful numbers, fitted by least squares (soft-L1) on
the log of predicted / measured step time:

- ``gemm_efficiency``: fraction of peak a large GEMM sustains;
- ``attention_efficiency``: fraction of peak the fused attention kernels sustain;
- ``memory_efficiency``: fraction of peak bandwidth the memory-bound kernels sustain;
- ``link_scale``: achieved / nominal bandwidth of the NVLink and NIC links (one factor for both);
- ``host_issue_s``: host time to issue one kernel (eager frameworks).

Each source weighs the same in the fit (residuals scaled by ``1/sqrt(rows of the source)``), so
vTrain's 1,549 rows do not drown a published table of five.

**A measured prior for the host.** Only vTrain's single-node runs are host-bound, so a fit without
them leaves ``host_issue_s`` where it starts. The A100's fit therefore has one more residual,
``log(host_issue_s / measured)``, weighing as one more source: the host time of a
Megatron-DeepSpeed layer measured on a CPU apart from every source (``bench/bench_megatron_host.py``,
``paratrain/data/measured/megatron_ds_host.json``: forward, recomputed forward and backward of a
layer whose kernels are tiny) over the kernels the cost model counts for that layer
(:func:`host_issue_prior`). The fit starts there too.

**Parts of one die.** torchtitan's H100 96 GB HBM2e at 500 W (``h100-hbm2e``) is the H100 SXM's die
and kernels under a power cap: its GEMM and attention efficiencies are the SXM part's times one
fitted clock factor (:data:`TIED`; the cap lowers the sustained clock of both alike), beside its own
memory efficiency, link scale and host time. Three sources measure the HBM2e part, all but one at
tp 8 and 8,192 tokens; five free numbers on the rows of two of them (a held-out fold) had the
attention efficiency set by nothing (2026-11-25: held out, torchtitan's 2024-12 page came out 13–57 %
slow with a free fit, 4–17 % with the tie). Leave-one-source-out: for every source,
fit on all the other sources (the devices the source uses) and predict the source; a calibration
that predicts only its own data is no fit.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from paratrain.errors import ConfigError
from paratrain.plan.publicruns import PublicRun, predict_step_s, run_cluster
from paratrain.plan.validate import Calibration, MeasuredRun, megatron_predictor, vtrain_cluster, with_calibration
from paratrain.spec.cluster import ClusterSpec

__all__ = [
    "Sample", "MeasuredLayer", "FIT_NAMES", "DEVICES", "TIED", "start_calibration", "predict_samples", "fit_device",
    "fit_devices", "cross_validate",
    "vtrain_samples", "public_samples", "layer_samples", "MEASURED_LAYERS_SOURCE", "HOST_PRIOR_DEVICES",
    "host_issue_prior",
]

DEVICES = ("a100", "h100", "h100-hbm2e")  # the keys of publicruns.DEVICE_CLUSTERS: one calibration each
FIT_NAMES = ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "link_scale", "host_issue_s")
# device -> the device whose kernel efficiencies it shares up to a clock factor (module docstring)
TIED = {"h100-hbm2e": "h100"}
TIED_NAMES = ("clock", "memory_efficiency", "link_scale", "host_issue_s")
_BOUNDS = {
    "clock": (0.5, 1.2),
    "gemm_efficiency": (0.3, 1.0),
    "attention_efficiency": (0.1, 1.0),
    "memory_efficiency": (0.2, 1.0),
    "link_scale": (0.2, 1.5),
    "host_issue_s": (0.0, 200e-6),
}
_SCALE = {"host_issue_s": 1e-5}  # fitted in units of 10 µs
# devices whose host issue time has a measured prior: the vTrain runs' framework (Megatron-DeepSpeed)
HOST_PRIOR_DEVICES = ("a100",)


@functools.lru_cache(maxsize=1)
def host_issue_prior() -> float:
    """Host time per modelled kernel of Megatron-DeepSpeed, measured apart from every source: the
    stored host time of one layer and micro-batch with full recomputation
    (``bench/bench_megatron_host.py``) over the kernels the cost model issues for it (a forward, the
    recomputed forward and the backward of a GPT layer with Megatron's fused element-wise kernels and
    explicit attention, as :func:`paratrain.plan.validate.megatron_predictor` prices vTrain's runs;
    the count does not depend on the layer's size)."""
    import json

    from paratrain.cost.compute import layer_ops, op_kernels
    from paratrain.data import DATA_DIR
    from paratrain.spec.model import ModelSpec

    doc = json.loads((DATA_DIR / "measured" / "megatron_ds_host.json").read_text(encoding="utf-8"))
    layer = ModelSpec(name="gpt", layers=1, hidden=1024, heads=16, seq=1024, vocab=50304, dtype="fp16")
    kernels = [op_kernels(o) for o in layer_ops(layer, tp=1, microbatch=1, fused=True, dtype="fp16", attention="math")]
    per_layer = sum(2 * f + bi + bw for f, bi, bw in kernels)
    return float(doc["layer_recompute_s"]) / per_layer


@dataclass(frozen=True)
class MeasuredLayer:
    """One transformer layer of the runtime's GPT timed on one GPU, forward and backward
    (``bench/bench_gpu_layer.py``; ``paratrain/data/measured/``): the device itself, without a
    framework's step around it. ``line`` is the row's place in its file (from 1)."""

    hidden: int
    heads: int
    seq: int
    microbatch: int
    line: int
    gpus: int = 1


@dataclass(frozen=True)
class Sample:
    source: str
    device: str  # a100 | h100 | h100-hbm2e
    run: MeasuredRun | PublicRun | MeasuredLayer
    measured_s: float


MEASURED_LAYERS_SOURCE = "h100-layers-measured"


def layer_samples() -> list[Sample]:
    """The layers measured on an H100 SXM (``paratrain/data/measured/h100_layers.json``), one sample
    each: forward + backward seconds."""
    import json

    from paratrain.data import DATA_DIR

    doc = json.loads((DATA_DIR / "measured" / "h100_layers.json").read_text(encoding="utf-8"))
    return [Sample(MEASURED_LAYERS_SOURCE, "h100",
                   MeasuredLayer(r["hidden"], r["heads"], r["seq"], r["microbatch"], i + 1),
                   r["forward_s"] + r["backward_s"]) for i, r in enumerate(doc["rows"])]


def vtrain_samples(runs: Sequence[MeasuredRun], source: str) -> list[Sample]:
    return [Sample(source, "a100", r, r.time_s) for r in runs]


def public_samples(runs: Sequence[PublicRun]) -> list[Sample]:
    return [Sample(r.source, r.device, r, r.time_s) for r in runs]


def start_calibration(cluster: ClusterSpec) -> Calibration:
    """The presets as a calibration: the device's efficiencies, the nominal links."""
    dev = cluster.device
    return Calibration(
        gemm_efficiency=dev.gemm_efficiency, memory_efficiency=dev.memory_efficiency,
        kernel_overhead_s=dev.kernel_overhead_s, intra_bandwidth_Bps=cluster.intra_link.bandwidth_Bps,
        intra_latency_s=cluster.intra_link.latency_s, link_efficiency=1.0, host_issue_s=dev.host_issue_s,
        attention_efficiency=dev.attention_efficiency,
    )


def _predict_one(
    sample: Sample, cal: Calibration | None, clusters: dict[str, ClusterSpec], megatron: Callable[..., float]
) -> float:
    from paratrain.plan import validate

    run = sample.run
    if isinstance(run, MeasuredLayer):
        return _layer_s(run, clusters[sample.device] if cal is None else with_calibration(clusters[sample.device], cal))
    if isinstance(run, MeasuredRun):
        cluster = vtrain_cluster(clusters["a100"], run.gpus, cal)
        return megatron(validate.run_model(run), cluster, validate.run_config(run))
    cluster = run_cluster(run, clusters)
    if cal is not None:
        cluster = with_calibration(cluster, cal)
    return predict_step_s(run, cluster)


def _layer_s(layer: MeasuredLayer, cluster: ClusterSpec) -> float:
    """The cost model's forward + backward of a measured layer: the runtime's eager block (unfused
    element-wise kernels) with fused attention, bf16, one GPU, no recomputation."""
    from paratrain.cost.stage import layer_cost
    from paratrain.parallel.config import Recompute
    from paratrain.spec.model import gpt_layer

    part = layer_cost(gpt_layer(layer.hidden, layer.heads, layer.seq), cluster.device, "bf16", 1, False,
                      layer.microbatch, Recompute.NONE, False, "flash")
    return part.forward_s + part.backward_input_s + part.backward_weight_s


def predict_samples(
    samples: Sequence[Sample], calibrations: dict[str, Calibration | None], clusters: dict[str, ClusterSpec],
    progress: Callable[[int, int], None] | None = None,
) -> list[float]:
    """Predicted step time of every sample with its device's calibration (``None``: the presets)."""
    megatron = megatron_predictor("analytic")
    out = []
    for s in samples:
        out.append(_predict_one(s, calibrations.get(s.device), clusters, megatron))
        if progress is not None:
            progress(len(out), len(samples))
    return out


def _calibration(start: Calibration, x: Sequence[float], parent: Calibration | None = None) -> Calibration:
    names = FIT_NAMES if parent is None else TIED_NAMES
    v = {n: float(xi) * _SCALE.get(n, 1.0) for n, xi in zip(names, x, strict=True)}
    if parent is not None:
        clock = v.pop("clock")
        v["gemm_efficiency"] = parent.gemm_efficiency * clock
        v["attention_efficiency"] = (parent.attention_efficiency or start.attention_efficiency or 0.5) * clock
    link = v.pop("link_scale")
    return dataclasses.replace(
        start, **v, intra_bandwidth_Bps=start.intra_bandwidth_Bps * link, link_efficiency=start.link_efficiency * link
    )


def fit_device(
    samples: Sequence[Sample], start: Calibration, clusters: dict[str, ClusterSpec], *, max_evaluations: int = 200,
    parent: Calibration | None = None,
) -> tuple[Calibration, dict[str, Any]]:
    """Least-squares fit of one device's calibration to ``samples`` (all on that device). With
    ``parent`` (the fitted calibration of the device it is :data:`TIED` to), its GEMM and attention
    efficiencies are the parent's times one fitted clock factor."""
    from scipy.optimize import least_squares

    if not samples:
        raise ConfigError("samples", "nothing to fit", "give measured runs of the device")
    devices = {s.device for s in samples}
    if len(devices) != 1:
        raise ConfigError("samples", f"mix devices {sorted(devices)}", "fit one device at a time")
    (device,) = devices
    counts: dict[str, int] = {}
    for s in samples:
        counts[s.source] = counts.get(s.source, 0) + 1
    weights = [1.0 / math.sqrt(counts[s.source]) for s in samples]
    megatron = megatron_predictor("analytic")
    prior = host_issue_prior() if device in HOST_PRIOR_DEVICES and parent is None else None

    def residuals(x: Sequence[float]) -> list[float]:
        cal = _calibration(start, x, parent)
        out = [w * math.log(_predict_one(s, cal, clusters, megatron) / s.measured_s)
               for s, w in zip(samples, weights, strict=True)]
        if prior is not None:  # the measured host time, as one more source
            out.append(math.log(max(cal.host_issue_s, 1e-9) / prior))
        return out

    start_x = {"gemm_efficiency": start.gemm_efficiency, "attention_efficiency": start.attention_efficiency or 0.5,
               "memory_efficiency": start.memory_efficiency, "link_scale": 1.0,
               "host_issue_s": prior if prior is not None else max(start.host_issue_s, 10e-6), "clock": 1.0}
    names = FIT_NAMES if parent is None else TIED_NAMES
    x0 = [min(max(start_x[n], _BOUNDS[n][0]), _BOUNDS[n][1]) / _SCALE.get(n, 1.0) for n in names]
    lo = [_BOUNDS[n][0] / _SCALE.get(n, 1.0) for n in names]
    hi = [_BOUNDS[n][1] / _SCALE.get(n, 1.0) for n in names]
    res = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.05, max_nfev=max_evaluations,
                        diff_step=0.02)
    report: dict[str, Any] = {"device": device, "rows": len(samples), "sources": sorted(counts),
                              "evaluations": int(res.nfev), "cost": float(res.cost)}
    if parent is not None:
        report["clock"] = float(res.x[0])
    if prior is not None:
        report["host_issue_prior_s"] = prior
    return _calibration(start, res.x, parent), report


# fits by (device, the sources fitted on): what leave-one-source-out's folds share
_FitCache = dict[tuple[str, tuple[str, ...]], tuple[Calibration, dict[str, Any] | None]]


def fit_devices(
    samples: Sequence[Sample], starts: dict[str, Calibration], clusters: dict[str, ClusterSpec], devices: Sequence[str],
    *, max_evaluations: int = 200, progress: Callable[[int, int, str], None] | None = None,
    cache: _FitCache | None = None,
) -> dict[str, tuple[Calibration, dict[str, Any] | None]]:
    """Each of ``devices`` fitted on its ``samples``, a :data:`TIED` device after (and on) its
    parent's fit, which is made for it if ``devices`` does not name the parent. A device no sample
    measures keeps its ``starts`` calibration (report None). ``cache`` keeps fits by device and the
    sources they were fitted on (leave-one-source-out refits a parent on the same rows for every
    held-out source of the tied device)."""
    order = [TIED[d] for d in devices if d in TIED and TIED[d] not in devices] + list(devices)
    order = sorted(dict.fromkeys(order), key=lambda d: d in TIED)  # parents first
    out: dict[str, tuple[Calibration, dict[str, Any] | None]] = {}
    for i, dev in enumerate(order):
        if progress is not None:
            progress(i, len(order), dev)
        rows = [s for s in samples if s.device == dev]
        key = (dev, tuple(sorted({s.source for s in rows})))
        if dev in TIED:  # a tied fit also depends on the rows its parent was fitted on
            key = (dev, key[1] + ("|",) + tuple(sorted({s.source for s in samples if s.device == TIED[dev]})))
        if cache is not None and key in cache:
            out[dev] = cache[key]
            continue
        parent = out[TIED[dev]][0] if dev in TIED else None
        out[dev] = fit_device(rows, starts[dev], clusters, max_evaluations=max_evaluations, parent=parent) if rows \
            else (starts[dev], None)
        if cache is not None:
            cache[key] = out[dev]
    return {d: out[d] for d in devices}


def _fold(src: str, samples: Sequence[Sample], starts: dict[str, Calibration], clusters: dict[str, ClusterSpec],
          max_evaluations: int, cache: _FitCache) -> list[float]:
    """One leave-one-source-out fold: ``src``'s samples predicted by fits on the others."""
    held = [s for s in samples if s.source == src]
    train = [s for s in samples if s.source != src]
    fits = fit_devices(train, starts, clusters, sorted({s.device for s in held}), max_evaluations=max_evaluations,
                       cache=cache)
    return predict_samples(held, {dev: cal for dev, (cal, _) in fits.items()}, clusters)


def cross_validate(
    samples: Sequence[Sample], starts: dict[str, Calibration], clusters: dict[str, ClusterSpec], *,
    max_evaluations: int = 200, progress: Callable[[int, int, str], None] | None = None, jobs: int = 1,
) -> dict[str, list[float]]:
    """Leave-one-source-out: the predicted time of every sample of each source by calibrations fitted
    on the other sources' samples of the same device. A device no other source measures keeps its
    ``starts`` calibration (and the report says so). ``jobs`` > 1 runs the folds in that many
    processes (the same figures: each fold is deterministic); the parents of :data:`TIED` devices
    that several folds share are fitted first, here, and handed to every fold."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError("jobs", f"must be a whole number >= 1, got {jobs!r}", "e.g. --jobs 2")
    sources = sorted({s.source for s in samples})
    cache: _FitCache = {}
    if jobs == 1:
        out: dict[str, list[float]] = {}
        for i, src in enumerate(sources):
            if progress is not None:
                progress(i, len(sources), src)
            out[src] = _fold(src, samples, starts, clusters, max_evaluations, cache)
        return out
    for src in sources:  # shared parent fits, once
        devs = {s.device for s in samples if s.source == src}
        parents = sorted({TIED[d] for d in devs if d in TIED} - devs)
        if parents:
            fit_devices([s for s in samples if s.source != src], starts, clusters, parents,
                        max_evaluations=max_evaluations, cache=cache)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    done: dict[str, list[float]] = {}
    with ProcessPoolExecutor(max_workers=min(jobs, len(sources)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_fold, src, samples, starts, clusters, max_evaluations, cache): src for src in sources}
        for fut in as_completed(futures):
            done[futures[fut]] = fut.result()
            if progress is not None:
                progress(len(done), len(sources), futures[fut])
    return {src: done[src] for src in sources}
