"""Fake cost functions for the planner's tests: simple closed forms whose optimum is known, so
the search, pruning and pinning are tested without the real cost model."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from paratrain.cost.types import ChunkCost, CollectiveCost
from paratrain.parallel.config import ParallelConfig, Recompute
from paratrain.plan.analytic import estimate
from paratrain.plan.backend import CostBackend, pipeline_inputs
from paratrain.spec.cluster import ClusterSpec
from paratrain.spec.model import ModelSpec

LAYER_FWD_S = 1e-3  # one layer, one sample, tp = 1
LAYER_WEIGHT_BYTES = 2e8
SAMPLE_ACT_BYTES = 5e7


def fake_chunk_costs(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig) -> list[ChunkCost]:
    out = []
    parts = config.layers_per_chunk(model.layers)
    n = len(parts)
    for k, nl in enumerate(parts):
        units = nl + (0.5 if k == 0 else 0.0) + (1.0 if k == n - 1 else 0.0)
        f = units * config.microbatch * LAYER_FWD_S / config.tp * (1.0 + 0.05 * (config.tp > 1))
        rc = {Recompute.NONE: 0.0, Recompute.SELECTIVE: 0.1 * f, Recompute.FULL: f}[config.recompute]
        act_scale = {Recompute.NONE: 1.0, Recompute.SELECTIVE: 0.6, Recompute.FULL: 0.1}[config.recompute]
        tp_split = config.tp if config.sequence_parallel else max(1.0, config.tp / 2)
        w = units * LAYER_WEIGHT_BYTES / config.tp
        out.append(
            ChunkCost(
                forward_s=f,
                backward_input_s=f,
                backward_weight_s=f,
                recompute_s=rc,
                tp_comm_s=0.02 * f * (config.tp > 1),
                activation_bytes=int(nl * config.microbatch * SAMPLE_ACT_BYTES * act_scale / tp_split),
                weight_bytes=int(w),
                grad_bytes=int(w),
                optimizer_bytes=int(6 * w / (config.dp if config.optimizer_sharding else 1)),
                grad_reduce_bytes=int(w),
                p2p_bytes=int(config.microbatch * 1e6),
                model_flops=1.0,
            )
        )
    return out


def fake_collective(kind: str, nbytes: float, ranks, cluster: ClusterSpec, algorithm=None) -> CollectiveCost:
    n = len(ranks)
    bw = cluster.intra_link.bandwidth_Bps if cluster.nodes_spanned(ranks) == 1 else cluster.inter_link.bandwidth_Bps
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n}.get(kind, 1.0)
    return CollectiveCost(time_s=1e-5 + factor * nbytes / bw, algorithm="ring", bytes_per_rank=factor * nbytes)


def fake_flops(model: ModelSpec, global_batch: int) -> float:
    return 6.0 * model.param_count() * global_batch * model.seq


@dataclass
class FakeSim:
    """Stands in for the simulator: the closed forms plus a fixed 1 % overhead."""

    backend: CostBackend | None = None
    calls: int = 0

    def __call__(self, model, cluster, config, *, overlap_grad_reduce=True):
        self.calls += 1
        chunks = fake_chunk_costs(model, cluster, config)
        est = estimate(
            config,
            pipeline_inputs(model, cluster, config, chunks, self.backend, overlap_grad_reduce=overlap_grad_reduce),
        )
        t = est.iteration_time_s * 1.01
        flops = fake_flops(model, config.global_batch)
        world = config.world_size
        return SimpleNamespace(
            iteration_time_s=t,
            tokens_per_s=config.global_batch * model.seq / t,
            samples_per_s=config.global_batch / t,
            tflops_per_gpu=flops / t / world / 1e12,
            mfu=flops / t / world / cluster.device.peak_flops(config.dtype),
            bubble_fraction=est.bubble_fraction,
            peak_memory_bytes=est.peak_memory_bytes,
            memory_by_rank=list(est.memory_by_rank),
            comm_time_by_kind={},
        )


@pytest.fixture
def fake_backend() -> CostBackend:
    sim = FakeSim()
    backend = CostBackend(
        chunk_costs=fake_chunk_costs, collective_time=fake_collective, model_flops=fake_flops, simulate=sim
    )
    sim.backend = CostBackend(chunk_costs=fake_chunk_costs, collective_time=fake_collective, model_flops=fake_flops)
    return backend
