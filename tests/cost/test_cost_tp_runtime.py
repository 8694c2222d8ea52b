"""Tensor parallelism as the runtime runs it: the collectives DTensor issues, their measured times,
DTensor's host dispatch, and the ``cpu`` cluster that carries them.

The counts are derived here from the runtime's own plan (``block_plan``: one DTensor style per
Linear), independently of :func:`paratrain.cost.tensor_parallel.tp_parts`; what DTensor really
issues on gloo is checked in tests/runtime/test_calibrate_tp.py.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from paratrain.cost.collectives import collective_time
from paratrain.cost.stage import chunk_costs
from paratrain.cost.tensor_parallel import measured_time, tp_part_cpu, tp_part_times, tp_parts
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.tensor_parallel import block_plan
from paratrain.sim.fit_links import links_document
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.cluster_presets import cluster_preset, cpu_cluster_calibration_path
from paratrain.spec.model import from_document, preset

GPT = dataclasses.replace(preset("gpt-tiny"), layers=8, hidden=256, heads=4, seq=128, vocab=256)
LLAMA = from_document({"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "seq": 32, "vocab": 128,
                       "norm": "rmsnorm", "activation": "swiglu", "position": "rotary", "tied_embeddings": False,
                       "bias": False, "dtype": "fp32", "name": "llama-like"})


def _counts(part_collectives) -> Counter:
    c: Counter = Counter()
    for x in part_collectives:
        c[(x.kind, x.nbytes)] += x.count
    return c


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_dtensor_layer_collectives_follow_the_runtime_plan(model, sp: bool) -> None:
    plan = block_plan(model.activation.value == "swiglu", sequence_parallel=sp)
    column = sum(isinstance(s, ColwiseParallel) for s in plan.values())
    row = sum(isinstance(s, RowwiseParallel) for s in plan.values())
    shared = sum(isinstance(s, PrepareModuleInput) for s in plan.values())  # attention's and MLP's input
    mb, e = 4, 4
    act = mb * model.seq * model.hidden * e
    layer = tp_parts(model, sequence_parallel=sp, microbatch=mb, dtype="fp32")["layer"]
    if not sp:
        # forward: each row-parallel Linear reduces its partial sums; backward: the column-parallel
        # Linears of a half-block share one input, whose summed partial gradient is reduced once
        # (as Megatron's fused QKV)
        assert _counts(layer.forward) == {("all_reduce", act): row}
        assert _counts(layer.backward) == {("all_reduce", act): shared}
        assert layer.modules == len(plan) == column + row + shared
    else:
        norm_tensors = 2 * (1 if model.norm.value == "rmsnorm" else 2)  # weight (+ bias) of two norms
        assert _counts(layer.forward) == {("all_gather", act): shared, ("reduce_scatter", act): row}
        assert _counts(layer.backward) == {("reduce_scatter", act): shared, ("all_gather", act): row,
                                           ("all_reduce", model.hidden * e): norm_tensors}
        # one dispatch for every module of the runtime's plan: the Linears, the two sequence-parallel
        # norms and the two inputs gathered back (attention and MLP)
        assert layer.modules == len(plan) == column + row + 2 + shared
    assert shared == 2
    assert (column, row) == ((5, 2) if model is LLAMA else (4, 2))


def test_megatron_keeps_two_all_reduces_per_layer_each_way() -> None:
    """Shoeybi et al. 2019, fig. 3: f and g, two all-reduces forward and two backward per layer."""
    parts = tp_parts(GPT, sequence_parallel=False, microbatch=2, dtype="bf16", runtime="megatron")
    act = 2 * GPT.seq * GPT.hidden * 2
    assert _counts(parts["layer"].forward) == _counts(parts["layer"].backward) == {("all_reduce", act): 2}
    assert parts["layer"].modules == 0
    sp = tp_parts(GPT, sequence_parallel=True, microbatch=2, dtype="bf16", runtime="megatron")["layer"]
    assert _counts(sp.forward) == {("all_gather", act): 2, ("reduce_scatter", act): 2}


def test_loss_parallel_reduces_three_fp32_values_per_token() -> None:
    head = tp_parts(GPT, sequence_parallel=False, microbatch=3, dtype="bf16")["head"]
    assert ("all_reduce", 4 * 3 * GPT.seq) in _counts(head.forward)
    assert _counts(head.forward)[("all_reduce", 4 * 3 * GPT.seq)] == 3


TABLE = (("all_reduce", 4, 1000, 0.010), ("all_reduce", 4, 3000, 0.030), ("all_reduce", 4, 5000, 0.041),
         ("all_reduce", 2, 1000, 0.002))


def test_measured_time_is_the_least_squares_line_through_the_sizes() -> None:
    c = dataclasses.replace(resolve_cluster("cpu", gpus=4), measured_collectives=TABLE)
    # closed form for x = 1000, 3000, 5000 and y = 10, 30, 41 ms: slope = sum(dx dy) / sum(dx^2)
    slope = (-2000 * -17e-3 + 0 + 2000 * 14e-3) / (2 * 2000**2)
    alpha = 27e-3 - slope * 3000
    for n in (10, 2000, 7000):
        assert measured_time(c, "all_reduce", 4, n) == pytest.approx(alpha + slope * n, rel=1e-12)
    assert measured_time(c, "all_reduce", 2, 123456) == 0.002  # one point: constant
    assert measured_time(c, "all_gather", 4, 1000) is None
    assert measured_time(c, "all_reduce", 8, 1000) is None
    flat = dataclasses.replace(c, measured_collectives=(("all_gather", 4, 10, 0.03), ("all_gather", 4, 20, 0.01)))
    assert measured_time(flat, "all_gather", 4, 10**6) == pytest.approx(0.02)  # falling: the mean
    steep = dataclasses.replace(c, measured_collectives=(("all_gather", 4, 10, 0.001), ("all_gather", 4, 20, 0.004)))
    assert measured_time(steep, "all_gather", 4, 30) == pytest.approx(30 * 0.09 / 500)  # through the origin


def test_chunk_tp_time_is_measured_collectives_plus_dispatch() -> None:
    """A one-stage tp=4 GPT on a cluster with a measured all-reduce table and dispatch: every
    collective at its table time, every module at its dispatch time, summed by hand."""
    base = resolve_cluster("cpu", gpus=4)
    dev = dataclasses.replace(base.device, tp_dispatch_forward_s=1e-4, tp_dispatch_backward_s=3e-4)
    mb = 4
    act, loss = mb * GPT.seq * GPT.hidden * 4, 4 * mb * GPT.seq
    table = (("all_reduce", 4, act, 0.01), ("all_reduce", 4, 2 * act, 0.015))  # alpha 5 ms
    cluster = dataclasses.replace(base, device=dev, measured_collectives=table, tensor_parallel="dtensor")
    (c,) = chunk_costs(GPT, cluster, ParallelConfig(tp=4, microbatch=mb, global_batch=16, dtype="fp32"))
    t_act, t_loss = 0.01, 0.005 + 0.005 * loss / act
    layer = (2 + 2) * t_act + 8 * (1e-4 + 3e-4)  # 6 Linears and the 2 shared inputs
    embedding = t_act + 1e-4 + 3e-4
    head = 3 * t_loss + t_act + 2 * (1e-4 + 3e-4)
    assert c.tp_comm_s == pytest.approx(GPT.layers * layer + embedding + head, rel=1e-12)


@pytest.mark.parametrize(("cores", "rate"), [(0, 1.0), (8, 1.0), (2, 0.5)])
def test_a_collectives_cpu_is_host_work_and_the_rest_a_wait(cores: int, rate: float) -> None:
    """An all-reduce over 4 processes measured at a = 10 ms with c = 3 ms of CPU, its group alone
    computing at r = min(1, cores / 4): a = c / r + l, so the wait is l = a - c / r, and at full
    speed the collective takes c + l; the chunk's host work (dispatch and the collectives' CPU)
    is what its time holds beyond its waits. With a loss all-reduce of another size the one row is
    its line's mean, so every all-reduce here costs c."""
    mb = 4
    act = mb * GPT.seq * GPT.hidden * 4
    base = dataclasses.replace(resolve_cluster("cpu", gpus=4), measured_collectives=(("all_reduce", 4, act, 0.01),),
                               tensor_parallel="dtensor", cores_per_node=cores)
    cpu = dataclasses.replace(base, collective_cpu_s=(("all_reduce", 4, act, 3e-3),))
    part = tp_parts(GPT, sequence_parallel=False, microbatch=mb, dtype="fp32")["layer"]
    wait = 0.01 - 3e-3 / rate
    f, b, _, _ = tp_part_times(part, cpu, (0, 1, 2, 3))
    assert (f, b) == pytest.approx((2 * (3e-3 + wait), 2 * (3e-3 + wait)), rel=1e-12)
    assert tp_part_cpu(part, cpu, (0, 1, 2, 3)) == pytest.approx((2 * 3e-3, 2 * 3e-3), rel=1e-12)
    assert tp_part_cpu(part, base, (0, 1, 2, 3)) == (0.0, 0.0)  # not measured: all of it a wait
    config = ParallelConfig(tp=4, microbatch=mb, global_batch=16, dtype="fp32")
    (with_cpu,), (without,) = chunk_costs(GPT, cpu, config), chunk_costs(GPT, base, config)
    n = GPT.layers
    # forward: 2 all-reduces per layer, the embedding's one and the loss's three, each waiting c / r less
    assert with_cpu.forward_wait_s - without.forward_wait_s == pytest.approx(-(2 * n + 4) * 3e-3 / rate, rel=1e-9)


def test_unmeasured_group_falls_back_to_the_alpha_beta_model() -> None:
    cluster = dataclasses.replace(resolve_cluster("cpu", gpus=4), measured_collectives=TABLE[3:],
                                  tensor_parallel="dtensor")
    part = tp_parts(GPT, sequence_parallel=False, microbatch=1, dtype="fp32")["layer"]
    f, b, _, _ = tp_part_times(part, cluster, (0, 1, 2, 3))
    act = GPT.seq * GPT.hidden * 4
    assert f == pytest.approx(2 * collective_time("all_reduce", act, (0, 1, 2, 3), cluster).time_s)
    assert b == pytest.approx(2 * collective_time("all_reduce", act, (0, 1, 2, 3), cluster).time_s)
    assert tp_part_times(part, cluster, (0,)) == (0.0, 0.0, 0.0, 0.0)


def test_gpu_presets_keep_megatron_and_the_cpu_cluster_reads_its_calibration() -> None:
    assert resolve_cluster("dgx-a100").tensor_parallel == "megatron"
    assert resolve_cluster("dgx-a100").measured_collectives == ()
    path = cpu_cluster_calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = links_document({4096: 1e-3, 2**20: 2e-3}, {4: 1e-3}, 4, 1, [("all_reduce", 4, 4096, 0.005)])
    path.write_text(json.dumps(doc))
    try:
        cpu = cluster_preset("cpu")
        assert cpu.tensor_parallel == "dtensor"
        assert cpu.measured_collectives == (("all_reduce", 4, 4096, 0.005),)
        path.write_text(json.dumps({**doc, "measured_collectives": [["all_reduce", 0, 1, 1.0]]}))
        assert cluster_preset("cpu").measured_collectives == ()  # a damaged table: the alpha-beta model
    finally:
        path.unlink()


@pytest.mark.parametrize("change, field", [
    ({"measured_collectives": [["all_reduce", 4, 4096]]}, "measured_collectives[0]"),
    ({"measured_collectives": [["all_reduce", 4, -1, 0.1]]}, "measured_collectives[0] bytes"),
    ({"measured_collectives": "fast"}, "measured_collectives"),
    ({"tensor_parallel": "deepspeed"}, "tensor_parallel"),
    ({"collective_cpu_s": [["all_reduce", 2, 4096, -1.0]]}, "collective_cpu_s[0] seconds"),
    ({"collective_cpu_s": "slow"}, "collective_cpu_s"),
    ({"collective_cpu_s": [[2]]}, "collective_cpu_s[0]"),
])
def test_bad_tensor_parallel_fields_name_the_field(change, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(resolve_cluster("cpu"), **change)
    assert e.value.field == field


def test_calibrate_prints_one_line_per_kind_and_group() -> None:
    from paratrain.cli.calibrate import tp_lines

    dev = dataclasses.replace(resolve_cluster("cpu").device, tp_dispatch_forward_s=2e-4, tp_dispatch_backward_s=5e-4)
    rows = [["all_reduce", 2, 4096, 0.001], ["all_reduce", 2, 2**21, 0.004], ["all_gather", 4, 4096, 0.002]]
    cpu = [["all_reduce", 2, 4096, 5e-4], ["all_reduce", 2, 2**21, 2e-3]]
    assert tp_lines(rows, dev, cpu) == [
        "tensor-parallel all-reduce over 2 processes in a layer (one group): 4 KiB 1.00 (CPU 0.50) ms, "
        "2 MiB 4.00 (CPU 2.00) ms",
        "tensor-parallel all-gather over 4 processes in a layer (one group): 4 KiB 2.00 ms",
        "DTensor dispatch per tensor-parallel module: forward 200 us, backward 500 us",
    ]


def test_partial_norm_gradients_are_reduced_once_per_step():
    # The runtime sums the sequence-parallel norms' partial gradients over a step's micro-batches and
    # all-reduces them once (runtime.tensor_parallel.accumulating_partial_grads): each micro-batch
    # carries 1/m of those all-reduces; the asynchronous schedules step per micro-batch and pay them all.
    from paratrain.cost.stage import partial_grad_accumulation

    e, m = 4, 8
    small = ("all_reduce", GPT.hidden * e)
    one = _counts(tp_parts(GPT, sequence_parallel=True, microbatch=2, dtype="fp32")["layer"].backward)
    acc = _counts(tp_parts(GPT, sequence_parallel=True, microbatch=2, dtype="fp32", accumulated=m)["layer"].backward)
    assert acc[small] == pytest.approx(one[small] / m) and one[small] == 4  # LayerNorm weight and bias, twice
    assert {k: v for k, v in acc.items() if k != small} == {k: v for k, v in one.items() if k != small}
    sync = ParallelConfig(tp=2, pp=2, microbatch=2, global_batch=2 * m, sequence_parallel=True)
    assert partial_grad_accumulation(sync) == m
    assert partial_grad_accumulation(dataclasses.replace(sync, schedule="pipedream")) == 1
    assert partial_grad_accumulation(dataclasses.replace(sync, sequence_parallel=False)) == 1
    # the chunk's backward is shorter by (m - 1)/m of its norms' all-reduces, nothing else moves
    from paratrain.cost.stage import tp_ranks
    from paratrain.cost.tensor_parallel import collective_s

    cluster = resolve_cluster("cpu", gpus=4)  # DTensor's collectives, as paratrain train runs them
    fp32 = dataclasses.replace(sync, dtype="fp32")
    many = chunk_costs(GPT, cluster, fp32)
    single = chunk_costs(GPT, cluster, dataclasses.replace(fp32, global_batch=2))  # one micro-batch
    saved = 4 * 4 * (1 - 1 / m) * collective_s(cluster, tp_ranks(fp32), *small)  # 4 layers a chunk
    assert saved > 0
    for a, b in zip(many, single, strict=True):
        assert a.forward_s == b.forward_s
        assert b.backward_s - a.backward_s == pytest.approx(saved, rel=1e-9)
