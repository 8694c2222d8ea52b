"""Per-chunk costs: consistency with the operator model, memory model and FLOPs function."""

from __future__ import annotations

import pytest

from paratrain.cost.collectives import collective_time
from paratrain.cost.compute import (
    embedding_ops,
    head_ops,
    layer_ops,
    op_time_split,
)
from paratrain.cost.flops import matmul_flops_per_iteration
from paratrain.cost.memory import activation_bytes_per_layer, static_memory
from paratrain.cost.stage import chunk_costs, layer_params_per_rank, tp_ranks
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import preset

DGX = resolve_cluster("dgx-a100", nodes=16)
GPT = preset("gpt3-13b")  # 40 layers, tied embeddings


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_one_chunk_equals_the_sum_of_its_operators(attention: str) -> None:
    cfg = ParallelConfig(microbatch=2, attention=attention)
    (c,) = chunk_costs(GPT, DGX, cfg)
    dev = DGX.device
    kw = dict(microbatch=2, dtype="bf16")
    layer = layer_ops(GPT, attention=attention, **kw)
    parts = [(1, embedding_ops(GPT, **kw)), (GPT.layers, layer), (1, head_ops(GPT, **kw))]
    fwd = sum(n * sum(op_time_split(o, dev, "bf16")[0] for o in ops) for n, ops in parts)
    bwd_in = sum(n * sum(op_time_split(o, dev, "bf16")[1] for o in ops) for n, ops in parts)
    bwd_w = sum(n * sum(op_time_split(o, dev, "bf16")[2] for o in ops) for n, ops in parts)
    assert c.forward_s == pytest.approx(fwd, rel=1e-12)
    assert c.backward_input_s == pytest.approx(bwd_in, rel=1e-12)
    assert c.backward_weight_s == pytest.approx(bwd_w, rel=1e-12)
    assert c.tp_comm_s == 0 and c.recompute_s == 0
    assert c.model_flops == pytest.approx(matmul_flops_per_iteration(GPT, 2), rel=1e-12)
    assert c.weight_bytes == 2 * GPT.param_count()
    mem = static_memory(GPT.param_count(), "bf16")
    assert c.static_bytes == mem.total_bytes == 18 * GPT.param_count()  # fp32 gradients of a bf16 model


@pytest.mark.parametrize("pp, v", [(4, 1), (3, 1), (2, 2), (8, 5)])
def test_chunks_in_pipeline_order(pp: int, v: int) -> None:
    sched = "interleaved" if v > 1 else "1f1b"
    cfg = ParallelConfig(pp=pp, virtual_stages=v, schedule=sched, tp=2, global_batch=8 * pp)
    cc = chunk_costs(GPT, DGX, cfg)
    counts = cfg.layers_per_chunk(GPT.layers)
    assert len(cc) == pp * v
    per_layer = [c.model_flops for c in cc]
    lf = sum(o.fwd_flops + o.bwd_flops for o in layer_ops(GPT, tp=2) if o.is_matmul)
    head_f = sum(o.fwd_flops + o.bwd_flops for o in head_ops(GPT, tp=2) if o.is_matmul)
    expect = [n * lf for n in counts]
    expect[-1] += head_f
    assert per_layer == pytest.approx(expect, rel=1e-12)
    # 50257 is odd: each of the 2 ranks computes ceil(V/2) logits, one padding column in all.
    padding = 3 * 2 * GPT.seq * GPT.hidden * (2 * -(-GPT.vocab // 2) - GPT.vocab)
    assert sum(per_layer) * 2 == pytest.approx(matmul_flops_per_iteration(GPT, 1) + padding, rel=1e-12)


def test_parameters_across_chunks_and_ranks() -> None:
    # Tied embeddings: the last stage keeps a copy of the word embedding (Megatron-LM).
    cc = chunk_costs(GPT, DGX, ParallelConfig(pp=4, global_batch=4))
    assert sum(c.weight_bytes for c in cc) == 2 * (GPT.param_count() + GPT.vocab * GPT.hidden)
    llama = preset("llama2-7b")  # untied: no copy
    cc = chunk_costs(llama, DGX, ParallelConfig(pp=4, global_batch=4))
    assert sum(c.weight_bytes for c in cc) == 2 * llama.param_count()
    assert layer_params_per_rank(GPT, 1) == GPT.params_per_layer()
    h = GPT.hidden
    replicated = 2 * GPT.norm_params() + 2 * h  # norms, row-parallel biases
    assert layer_params_per_rank(GPT, 8) * 8 == GPT.params_per_layer() + 7 * replicated


@pytest.mark.parametrize("dp", [1, 4, 64])
def test_optimizer_sharding_and_reduce_bytes(dp: int) -> None:
    cfg = ParallelConfig(dp=dp, sharding="zero1", global_batch=dp)  # optimizer state only
    (c,) = chunk_costs(GPT, resolve_cluster("dgx-a100", nodes=8), cfg)
    p = GPT.param_count()
    assert c.optimizer_bytes == -(-12 * p // dp)
    assert c.grad_reduce_bytes == 2 * p and c.grad_bytes == 4 * p  # bf16 gradients kept in fp32


@pytest.mark.parametrize("sp", [False, True])
def test_p2p_and_activation_bytes(sp: bool) -> None:
    cfg = ParallelConfig(pp=4, tp=4, microbatch=2, sequence_parallel=sp, recompute="selective", global_batch=8,
                         attention="math")
    cc = chunk_costs(GPT, DGX, cfg)
    # Megatron sends 1/tp of the activation either way: sequence-split, or scattered and gathered
    # again on arrival (all-gather of the whole bf16 activation over the 4 tensor-parallel ranks)
    act = 2 * GPT.seq * GPT.hidden * 2
    gather = 0.0 if sp else collective_time("all_gather", act, (0, 1, 2, 3), DGX).time_s
    assert all(c.p2p_bytes == act // 4 and c.p2p_gather_s == pytest.approx(gather, rel=1e-12) for c in cc)
    mid = cc[1]
    per_layer = activation_bytes_per_layer(GPT, microbatch=2, tp=4, sequence_parallel=sp, recompute="selective")
    assert mid.activation_bytes == 10 * per_layer
    assert cc[0].activation_bytes > mid.activation_bytes and cc[-1].activation_bytes > mid.activation_bytes


def test_paratrains_runtime_sends_each_ranks_full_activation() -> None:
    # DTensor's pipeline (runtime/pipeline.py) sends every tensor-parallel rank's replicated
    # activation whole; with sequence parallelism each rank's sequence slice
    cpu = resolve_cluster("cpu", gpus=8)
    assert cpu.tensor_parallel == "dtensor"
    for sp, expected in ((False, 2 * GPT.seq * GPT.hidden * 4), (True, 2 * GPT.seq * GPT.hidden * 4 // 4)):
        cfg = ParallelConfig(pp=2, tp=4, microbatch=2, sequence_parallel=sp, global_batch=8, dtype="fp32")
        assert all(c.p2p_bytes == expected and c.p2p_gather_s == 0 for c in chunk_costs(GPT, cpu, cfg))


def test_recomputation_times() -> None:
    base = dict(pp=4, tp=8, global_batch=4, attention="math")  # selective recomputes the explicit s×s core
    none, sel, full = (chunk_costs(GPT, DGX, ParallelConfig(recompute=r, **base))[1] for r in
                       ("none", "selective", "full"))
    assert none.recompute_s == 0
    assert full.recompute_s == pytest.approx(full.forward_s, rel=1e-12)  # a middle chunk: layers only
    assert 0 < sel.recompute_s < full.recompute_s
    assert full.activation_bytes == 10 * 2 * GPT.seq * GPT.hidden
    # While one layer runs its backward, what it recomputed is live once (not per micro-batch).
    whole = activation_bytes_per_layer(GPT, tp=8)
    assert none.transient_bytes == 0
    assert full.transient_bytes == whole - 2 * GPT.seq * GPT.hidden
    assert sel.transient_bytes == 5 * GPT.heads * GPT.seq**2 // 8  # the attention core, a/t heads
    assert full.tp_comm_s > none.tp_comm_s  # the recomputed forward repeats its all-reduces


def test_tensor_parallel_collectives_follow_placement() -> None:
    cfg = ParallelConfig(tp=8, dp=2, global_batch=2)
    assert tp_ranks(cfg) == cfg.group_ranks("tp")[0] == tuple(range(8))
    (inside,) = chunk_costs(GPT, DGX, cfg)
    ar = collective_time("all_reduce", GPT.seq * GPT.hidden * 2, range(8), DGX).time_s
    loss = 3 * collective_time("all_reduce", 4 * GPT.seq, range(8), DGX).time_s
    # 4 all-reduces per layer, one in the embedding, one in the head, three tiny ones for the loss
    assert inside.tp_comm_s == pytest.approx((4 * GPT.layers + 2) * ar + loss, rel=1e-12)
    spread_cfg = ParallelConfig(tp=8, dp=8, mesh_order=("tp", "pp", "dp"), global_batch=8)
    assert tp_ranks(spread_cfg) == spread_cfg.group_ranks("tp")[0] == tuple(range(0, 64, 8))
    (spread,) = chunk_costs(GPT, DGX, spread_cfg)
    assert spread.tp_comm_s > 5 * inside.tp_comm_s  # NIC instead of NVLink
    (solo,) = chunk_costs(GPT, DGX, ParallelConfig())
    assert solo.tp_comm_s == 0


def test_bad_configurations() -> None:
    with pytest.raises(ConfigError, match="tp"):
        chunk_costs(GPT, DGX, ParallelConfig(tp=3))
    with pytest.raises(ConfigError, match="tp"):
        chunk_costs(GPT, resolve_cluster("dgx-a100", gpus=4), ParallelConfig(tp=8))
    with pytest.raises(ConfigError, match="pp"):
        chunk_costs(GPT, DGX, ParallelConfig(pp=41, global_batch=41))


def test_explicit_partition() -> None:
    part = (5, 10, 15, 10)
    cc = chunk_costs(GPT, DGX, ParallelConfig(pp=4, partition=part, global_batch=4))
    (one,) = chunk_costs(GPT.with_overrides(layers=1), DGX, ParallelConfig())  # embedding + 1 layer + head
    lf = cc[1].forward_s / 10
    assert [c.forward_s for c in cc[1:3]] == pytest.approx([10 * lf, 15 * lf], rel=1e-12)
    assert cc[0].forward_s > 5 * lf and cc[3].forward_s > 10 * lf  # embedding / head on the ends
    assert one.forward_s == pytest.approx(cc[0].forward_s - 4 * lf + cc[3].forward_s - 10 * lf, rel=1e-12)
