"""What the planner reports about its winner: the DESIGN.md keys and a readable breakdown."""

from __future__ import annotations

from typing import Any

from paratrain.spec.cluster import ClusterSpec
from paratrain.spec.model import ModelSpec

__all__ = ["DESIGN_KEYS", "winner_keys", "winner_breakdown"]

# Keys every `simulate --json` / `plan --json` object carries (shared/DESIGN.md).
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


def _analytic_comm(cand: Any) -> dict[str, float]:
    est = cand.estimate
    return {"exposed": est.exposed_comm_s, "grad_reduce_exposed": est.exposed_grad_reduce_s}


def winner_keys(cand: Any) -> dict[str, Any]:
    """The DESIGN.md keys: the simulator's values when it ran, the closed forms' otherwise."""
    if cand.simulated is not None:
        sim = cand.simulated
        d = sim.to_dict() if hasattr(sim, "to_dict") else {k: getattr(sim, k) for k in DESIGN_KEYS}
        d["source"] = "simulator"
    else:
        m = cand.analytic
        d = {
            "iteration_time_s": m.iteration_time_s,
            "tokens_per_s": m.tokens_per_s,
            "samples_per_s": m.samples_per_s,
            "tflops_per_gpu": m.tflops_per_gpu,
            "mfu": m.mfu,
            "bubble_fraction": m.bubble_fraction,
            "peak_memory_bytes": m.peak_memory_bytes,
            "memory_by_rank": list(cand.estimate.memory_by_rank),
            "comm_time_by_kind": _analytic_comm(cand),
            "source": "analytic",
        }
    d["analytic_iteration_time_s"] = cand.analytic.iteration_time_s
    d["exposed_comm_s"] = cand.metrics.exposed_comm_s
    return d


def winner_breakdown(model: ModelSpec, cluster: ClusterSpec, cand: Any) -> list[tuple[str, str]]:
    """(label, value) lines describing the winning configuration and where its time goes."""
    cfg, est, m = cand.config, cand.estimate, cand.metrics
    parts = cfg.layers_per_chunk(model.layers)
    sched = cfg.schedule.value + (f", {cfg.virtual_stages} chunks per rank" if cfg.virtual_stages > 1 else "")
    lines = [
        ("model", f"{model.name}: {model.param_count() / 1e9:.1f}B parameters, {model.layers} layers"),
        ("cluster", f"{cfg.world_size} × {cluster.device.name} ({cluster.name}, {cluster.nodes} nodes)"),
        ("layout dp × tp × pp", f"{cfg.dp} × {cfg.tp} × {cfg.pp}, mesh {','.join(cfg.mesh_order)} (outermost first)"),
        ("micro-batch / micro-batches", f"{cfg.microbatch} / {cfg.num_microbatches} per replica"),
        ("schedule", sched),
        ("recomputation", cfg.recompute.value),
        ("sequence parallel", "on" if cfg.sequence_parallel else "off"),
        ("optimizer-state sharding", "on" if cfg.optimizer_sharding else "off"),
        ("layers per chunk", ",".join(map(str, parts)) + (" (balanced)" if cfg.partition is not None else " (even)")),
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
            f"{m.peak_memory_bytes / 2**30:.1f} GiB of {cluster.device.memory_bytes / 2**30:.0f} GiB",
        ),
    ]
    sim = cand.simulated
    if sim is not None and getattr(sim, "comm_time_by_kind", None):
        comm = ", ".join(f"{k} {v:.3f} s" for k, v in sim.comm_time_by_kind.items())
        lines.append(("communication by kind (sim)", comm))
    return lines
