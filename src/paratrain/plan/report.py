"""What the planner reports: the winner's interface keys (``iteration_time_s``, ``tokens_per_s``, …),
a readable breakdown, the JSON document of a search, and the one flat row of a configuration's
layout that every table and sweep uses."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from paratrain.parallel.config import ParallelConfig, prefetch_receives_on
from paratrain.plan.search import Candidate, Metrics, PlanResult
from paratrain.spec.cluster import ClusterSpec
from paratrain.spec.model import ModelSpec

__all__ = [
    "DESIGN_KEYS",
    "LAYOUT_FIELDS",
    "candidate_row",
    "layout_row",
    "plan_document",
    "winner_breakdown",
    "winner_keys",
    "winner_plausibility",
]

# Keys every `simulate --json` / `plan --json` object carries.
DESIGN_KEYS = (
    "iteration_time_s",
    "tokens_per_s",
    "samples_per_s",
    "tflops_per_gpu",
    "mfu",
    "bubble_fraction",
    "peak_memory_bytes",
    "memory_by_rank",
    "comm_time_by_kind",
)


# The fields of a ParallelConfig that describe a layout, in the order tables and sweeps show them.
LAYOUT_FIELDS = (
    "dp",
    "tp",
    "pp",
    "cp",
    "microbatch",
    "schedule",
    "virtual_stages",
    "recompute",
    "sequence_parallel",
    "optimizer_sharding",
    "sharding",
    "mesh_order",
)


def layout_row(config: ParallelConfig, fields: tuple[str, ...] = LAYOUT_FIELDS) -> dict[str, Any]:
    """``fields`` of ``config`` as JSON-ready values (enum names as strings, tuples as lists)."""
    d = config.to_dict()
    return {f: d[f] for f in fields}


def _analytic_comm(cand: Candidate) -> dict[str, float]:
    est = cand.estimate
    return {"exposed": est.exposed_comm_s, "grad_reduce_exposed": est.exposed_grad_reduce_s}


def _throughput_keys(m: Metrics) -> dict[str, Any]:
    """The interface keys one prediction gives, in the order every document prints them."""
    return {
        "iteration_time_s": m.iteration_time_s,
        "tokens_per_s": m.tokens_per_s,
        "samples_per_s": m.samples_per_s,
        "tflops_per_gpu": m.tflops_per_gpu,
        "mfu": m.mfu,
        "bubble_fraction": m.bubble_fraction,
        "peak_memory_bytes": m.peak_memory_bytes,
    }


def winner_keys(cand: Candidate) -> dict[str, Any]:
    """The interface keys: the simulator's values when it ran, the closed forms' otherwise."""
    if cand.simulated is not None:
        d = cand.simulated.to_dict()
        d["source"] = "simulator"
    else:
        d = {
            **_throughput_keys(cand.analytic),
            "memory_by_rank": list(cand.estimate.memory_by_rank),
            "comm_time_by_kind": _analytic_comm(cand),
            "source": "analytic",
        }
    d["analytic_iteration_time_s"] = cand.analytic.iteration_time_s
    d["exposed_comm_s"] = cand.metrics.exposed_comm_s
    return d


def candidate_row(cand: Candidate) -> dict[str, Any]:
    """One ranked candidate as a JSON-ready mapping."""
    m = cand.metrics
    return {
        "parallel": cand.config.to_dict(),
        "source": cand.source,
        **_throughput_keys(m),
        "exposed_comm_s": m.exposed_comm_s,
        "analytic_iteration_time_s": cand.analytic.iteration_time_s,
    }


def plan_document(model: ModelSpec, cluster: ClusterSpec, result: PlanResult) -> dict[str, Any]:
    """The winner's interface keys, the chosen config as a run document, and the ranking."""
    win = result.winner
    doc = winner_keys(win)
    doc["sharding"] = win.config.sharding
    doc["config"] = {"parallel": win.config.to_dict(), "model": model.to_dict(), "cluster": cluster.to_dict()}
    doc["candidates"] = [candidate_row(c) for c in result.ranked]
    doc["rejected"] = dict(sorted(result.rejected.items()))
    doc["considered"] = result.considered
    doc["evaluated"] = result.evaluated
    doc["memory_checked"] = result.memory_checked
    doc["search_time_s"] = result.search_time_s
    doc["plausibility_warnings"] = winner_plausibility(model, cluster, win)
    return doc


def winner_plausibility(model: ModelSpec, cluster: ClusterSpec, cand: Candidate) -> list[str]:
    """Warnings when the candidate's MFU exceeds the best measured on its device for a model of its
    size (:mod:`paratrain.plan.plausibility`)."""
    from paratrain.cost.compute import resolve_attention
    from paratrain.plan.plausibility import plausibility_warnings

    m = cand.metrics
    return plausibility_warnings(
        model, cluster, mfu=m.mfu, bubble_fraction=m.bubble_fraction,
        exposed_comm_fraction=m.exposed_comm_s / m.iteration_time_s if m.iteration_time_s else 0.0,
        attention=resolve_attention(cand.config.attention, cluster.device),
    )


def _runs(values: Sequence[int]) -> str:
    """Consecutive repeats as ``value × count``, in chunk order: 96 ones print as ``1 × 96``,
    (13, 12, 12, 11) as ``13, 12 × 2, 11``."""
    out: list[str] = []
    for v, group in itertools.groupby(values):
        n = len(list(group))
        out.append(f"{v} × {n}" if n > 1 else str(v))
    return ", ".join(out)


def winner_breakdown(
    model: ModelSpec, cluster: ClusterSpec, cand: Candidate, capacity_bytes: float | None = None
) -> list[tuple[str, str]]:
    """(label, value) lines describing the winning configuration and where its time goes;
    ``capacity_bytes`` is the memory the search allowed (default: the device's usable memory)."""
    cfg, est, m = cand.config, cand.estimate, cand.metrics
    usable = cluster.device.usable_memory_bytes if capacity_bytes is None else capacity_bytes
    parts = cfg.layers_per_chunk(model.layers)
    sched = cfg.schedule.value + (f", {cfg.virtual_stages} chunks per rank" if cfg.virtual_stages > 1 else "")
    lines = [
        ("model", f"{model.name}: {model.param_count() / 1e9:.1f}B parameters, {model.layers} layers"),
        ("cluster", f"{cfg.world_size} × {cluster.device.name} ({cluster.name}, {cluster.nodes} nodes)"),
        ("layout dp × tp × pp × cp", f"{cfg.dp} × {cfg.tp} × {cfg.pp} × {cfg.cp}, mesh {','.join(cfg.mesh_order)}"
         " (outermost first)"),
        ("micro-batch / micro-batches", f"{cfg.microbatch} / {cfg.num_microbatches} per replica"),
        ("schedule", sched),
        *([("receives posted ahead", f"{ahead} per peer" + (" (the backend's default)" if cfg.prefetch_receives is None
                                                           else ""))]
          if cfg.pp > 1 and (ahead := prefetch_receives_on(cfg, gloo=cluster.trains_with_gloo)) else []),
        ("recomputation", cfg.recompute.value),
        ("sequence parallel", "on" if cfg.sequence_parallel else "off"),
        *([("linear GEMMs", f"{cfg.gemm_dtype}" + (", weights cast once per step (cached)" if cfg.fp8_weight_cache
                                                   else ", weights cast every micro-batch"))]
          if cfg.gemm_dtype is not None else []),
        *([("tensor-parallel overlap", {"async": "async (torch's async TP: the forward's collectives)",
                                        "userbuffers": "userbuffers (forward and backward)"}[cfg.tp_overlap])]
          if cfg.tp_overlap != "none" else []),
        ("sharded data parallel", {"none": "off", "zero1": "zero1 (optimizer state)",
                                   "zero2": "zero2 (optimizer state, gradients)",
                                   "zero3": "zero3 (optimizer state, gradients, parameters)"}[cfg.sharding]),
        ("gradient compression", "off (dense all-reduce)" if cfg.compression == "none" else cfg.compression
         + ("" if cfg.compression == "powersgd" else f", density {cfg.compression_density:g}")),
        ("layers per chunk", _runs(parts) + (" (balanced)" if cfg.partition is not None else " (even)")),
        (
            "iteration time",
            f"{m.iteration_time_s:.3f} s ({cand.source}; closed form {cand.analytic.iteration_time_s:.3f} s)",
        ),
        ("  pipeline (fill + steady)", f"{est.pipeline_time_s:.3f} s"),
        ("  exposed gradient reduce", f"{est.exposed_grad_reduce_s:.3f} s"),
        ("  optimizer step", f"{est.optimizer_s:.3f} s"),
        ("throughput", f"{m.tokens_per_s:,.0f} tokens/s, {m.samples_per_s:.1f} samples/s"),
        ("TFLOP/s per GPU, MFU", f"{m.tflops_per_gpu:.1f}, {100 * m.mfu:.1f}%"),
        ("bubble", f"{100 * m.bubble_fraction:.1f}% of the iteration"),
        ("exposed communication", f"{m.exposed_comm_s:.3f} s (tensor-parallel, pipeline transfers, gradient reduce)"),
        (
            "peak memory per GPU",
            f"{m.peak_memory_bytes / 2**30:.1f} GiB of {usable / 2**30:.1f} GiB usable"
            f" ({cluster.device.memory_bytes / 2**30:.0f} GiB device)",
        ),
    ]
    sim = cand.simulated
    if sim is not None and sim.comm_time_by_kind:
        comm = ", ".join(f"{k} {v:.3f} s" for k, v in sim.comm_time_by_kind.items())
        lines.append(("communication by kind (sim)", comm))
    return lines
