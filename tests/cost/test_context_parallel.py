"""Context parallelism (cp): ring attention's closed forms, the cost model and simulator wiring,
the planner choosing cp where nothing else fits, world-size accounting and bad input."""

from __future__ import annotations

import pytest

from paratrain.cli import main
from paratrain.cost.collectives import collective_time
from paratrain.cost.compute import kv_dim_per_rank
from paratrain.cost.context_parallel import (
    kv_block_bytes,
    local_model,
    ring_buffer_bytes,
    ring_exposed_s,
    ring_neighbours,
    ring_step_bytes,
    ring_steps,
)
from paratrain.cost.memory import activation_bytes_per_layer
from paratrain.cost.stage import chunk_costs, cp_ranks, layer_cost
from paratrain.errors import ConfigError
from paratrain.parallel.config import AXES, ParallelConfig, Recompute
from paratrain.plan.backend import default_backend
from paratrain.plan.search import plan
from paratrain.plan.space import Pins, Rejections, layouts
from paratrain.sim.report import simulate_config
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import resolve_model

LLAMA = resolve_model("llama3-8b", seq=32768)  # GQA: 8 key/value heads of 128


# ----- closed forms -------------------------------------------------------------------------------
def test_ring_has_cp_minus_one_steps_and_closes():
    assert [ring_steps(c) for c in (1, 2, 4, 16)] == [0, 1, 3, 15]
    assert ring_neighbours((0, 2, 4, 6)) == ((0, 2), (2, 4), (4, 6), (6, 0))
    assert ring_neighbours((5,)) == ()


def test_bytes_per_step_are_one_k_and_v_block_and_twice_that_backward():
    # K and V of s/cp tokens over the kv heads a tensor-parallel rank holds, bf16:
    # 2 (K, V) × b × s/cp × (kv_heads/tp × head_dim) × 2 bytes.
    s, cp, tp, b = 32768, 4, 2, 2
    expected = 2 * b * (s // cp) * (8 // tp * 128) * 2
    assert kv_dim_per_rank(LLAMA, tp) == 8 // tp * 128
    assert kv_block_bytes(LLAMA, cp=cp, tp=tp, microbatch=b, dtype="bf16") == expected
    assert ring_step_bytes(LLAMA, cp=cp, tp=tp, microbatch=b, dtype="bf16") == expected
    assert ring_step_bytes(LLAMA, cp=cp, tp=tp, microbatch=b, dtype="bf16", backward=True) == 2 * expected
    assert ring_step_bytes(LLAMA, cp=1) == 0 and ring_buffer_bytes(LLAMA, cp=1) == 0
    assert ring_buffer_bytes(LLAMA, cp=cp, tp=tp, microbatch=b, dtype="bf16") == 4 * expected


def test_exposed_time_when_compute_is_shorter_and_when_longer_than_the_transfer():
    # cp = 4: three transfers, each against one of four equal attention blocks.
    assert ring_exposed_s(attention_s=1.0, transfer_s=1.0, cp=4) == pytest.approx(3 * (1.0 - 0.25))
    assert ring_exposed_s(attention_s=8.0, transfer_s=1.0, cp=4) == 0.0  # block 2.0 > transfer 1.0
    assert ring_exposed_s(attention_s=4.0, transfer_s=1.0, cp=4) == 0.0  # equal: hidden exactly
    assert ring_exposed_s(attention_s=5.0, transfer_s=9.0, cp=1) == 0.0  # no ring


def test_local_model_keeps_the_parameters():
    gpt = resolve_model("gpt3-1.3b", seq=8192)  # learned positions: the table keeps all rows
    for m in (gpt, LLAMA):
        loc = local_model(m, 4)
        assert loc.seq == m.seq // 4 and loc.param_count() == m.param_count()


# ----- cost model ------------------------------------------------------------------------------------
H100 = resolve_cluster("dgx-h100", "--cluster", gpus=16)


def test_activation_memory_and_flops_per_rank_are_the_totals_over_cp():
    # Flash attention stores O(s) per layer, so s/cp tokens hold exactly 1/cp of it.
    full = activation_bytes_per_layer(LLAMA, tp=2, sequence_parallel=True, attention="flash")
    half = activation_bytes_per_layer(local_model(LLAMA, 2), tp=2, sequence_parallel=True, attention="flash")
    assert 2 * half == full
    one = chunk_costs(LLAMA, H100, ParallelConfig(tp=2, global_batch=1, attention="flash"))[0]
    two = chunk_costs(LLAMA, H100, ParallelConfig(tp=2, cp=2, global_batch=1, attention="flash"))[0]
    # linear layers on s/cp tokens, attention cp blocks of (s/cp)²: the total over cp, term by term
    assert two.model_flops == pytest.approx(one.model_flops / 2, rel=1e-12)
    assert 2 * two.activation_bytes == one.activation_bytes
    assert two.weight_bytes == one.weight_bytes  # parameters replicated over cp


def test_optimizer_state_is_sharded_over_dp_times_cp():
    one = chunk_costs(LLAMA, H100, ParallelConfig(dp=2, global_batch=2, sharding="zero1"))[0]
    two = chunk_costs(LLAMA, H100, ParallelConfig(dp=2, cp=2, global_batch=2, sharding="zero1"))[0]
    assert two.optimizer_bytes == -(-one.optimizer_bytes * 2 // 4)  # ceil(state / (dp·cp)) from ceil(state / dp)
    assert two.weight_bytes == one.weight_bytes


def test_chunk_cost_charges_the_exposed_ring_time_in_closed_form():
    # cp outermost: the ring crosses the network between two DGX H100 nodes.
    cluster = H100
    model = resolve_model("llama3-8b", seq=512, layers=2)  # short: the transfer outlasts a block
    cfg = ParallelConfig(tp=8, cp=2, global_batch=1, mesh_order=("cp", "pp", "dp", "tp"))
    ranks = cp_ranks(cfg)
    assert ranks == (0, 8) and cluster.node_of(0) != cluster.node_of(8)
    (chunk,) = chunk_costs(model, cluster, cfg)
    loc = local_model(model, 2)
    layer = layer_cost(loc, cluster.device, "bf16", 8, False, 1, Recompute.NONE, False, "flash", 2)
    kv = kv_block_bytes(model, cp=2, tp=8, dtype="bf16")
    t_f = collective_time("p2p", kv, ranks, cluster).time_s
    t_b = collective_time("p2p", 2 * kv, ranks, cluster).time_s
    per_layer = ring_exposed_s(layer.attention_forward_s, t_f, 2) + ring_exposed_s(layer.attention_backward_s, t_b, 2)
    assert per_layer > 0  # the transfer is longer than half the attention here
    assert chunk.cp_comm_s == pytest.approx(model.layers * per_layer)
    # the simulator: one forward and one backward of the only micro-batch, logged and summed as kind "cp"
    res = simulate_config(model, cluster, cfg, record=True)
    logged = sum(r.time_s for r in res.comm_log if r.kind == "cp")
    assert res.comm_time_by_kind["cp"] == pytest.approx(chunk.cp_comm_s) == pytest.approx(logged)


def test_simulator_reports_cp_time_and_reduces_gradients_over_dp_times_cp():
    cfg = ParallelConfig(dp=2, tp=2, cp=4, global_batch=4)
    assert cfg.world_size == 16
    res = simulate_config(LLAMA, H100, cfg, record=True)
    assert "cp" in res.comm_time_by_kind
    reduce = [r for r in res.comm_log if r.kind == "all_reduce" and r.bytes > 4]  # not the grad-norm scalar
    assert reduce and all(len(r.group) == 8 for r in reduce)  # dp 2 × cp 4
    plain = simulate_config(LLAMA, H100, ParallelConfig(dp=8, tp=2, global_batch=8))
    assert "cp" not in plain.comm_time_by_kind


# ----- layout and world size --------------------------------------------------------------------------
def test_mesh_puts_cp_next_to_tp_and_reads_old_three_axis_orders():
    assert AXES == ("pp", "dp", "cp", "tp")  # Megatron-LM's "tp-cp-ep-dp-pp", innermost first
    c = ParallelConfig(dp=2, tp=2, pp=2, cp=2, global_batch=4)
    assert c.world_size == 16 and c.mesh_order == AXES
    assert c.group_ranks("tp")[0] == (0, 1) and c.group_ranks("cp")[0] == (0, 2)
    assert c.group_ranks("dp")[0] == (0, 4) and c.group_ranks("pp")[0] == (0, 8)
    assert ParallelConfig(mesh_order=("dp", "pp", "tp")).mesh_order == ("dp", "pp", "cp", "tp")
    assert ParallelConfig.from_dict({"mesh_order": ["tp", "dp", "pp"]}).mesh_order == ("cp", "tp", "dp", "pp")
    assert ParallelConfig.from_dict(c.to_dict()) == c


# ----- planner ------------------------------------------------------------------------------------------
def test_planner_chooses_cp_where_nothing_else_fits():
    model = resolve_model("llama3-8b", seq=262144)
    limit = 30 * 2**30
    backend = default_backend(simulate=False)
    with pytest.raises(ConfigError, match="fits no configuration"):
        plan(model, H100, 4, pins=Pins(cp=1), backend=backend, memory_limit_bytes=limit)
    win = plan(model, H100, 4, backend=backend, memory_limit_bytes=limit).winner
    assert win.config.cp > 1 and win.metrics.peak_memory_bytes <= limit


def test_search_keeps_the_ring_in_a_node_unless_nothing_fits():
    model = resolve_model("llama3-8b", seq=262144)
    pruned = layouts(model, H100, 4, Pins(), Rejections())
    every = layouts(model, H100, 4, Pins(), Rejections(), with_cp=True)
    assert {(x.tp, x.cp) for x in pruned if x.cp > 1} == {(t, c) for t in (1, 2, 4) for c in (2, 4, 8) if t * c <= 8}
    assert (1, 16) in {(x.tp, x.cp) for x in every} and (8, 2) in {(x.tp, x.cp) for x in every}


def test_short_sequences_search_no_cp():
    model = resolve_model("gpt3-1.3b")  # seq 2048, fits without
    res = plan(model, resolve_cluster("dgx-a100", "--cluster", gpus=8), 16, backend=default_backend(simulate=False))
    assert all(c.config.cp == 1 for c in res.ranked)


# ----- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, field", [
    (dict(cp=0), "cp"),
    (dict(cp=2, attention="math"), "cp"),
    (dict(mesh_order=("pp", "dp")), "mesh_order"),
    (dict(mesh_order=("pp", "dp", "tp", "tp")), "mesh_order"),
])
def test_bad_config_is_a_config_error(kw, field):
    with pytest.raises(ConfigError) as e:
        ParallelConfig(**kw)
    assert e.value.field == field


def test_sequence_must_split_into_two_chunks_per_rank():
    with pytest.raises(ConfigError, match="2\\*cp"):
        ParallelConfig(cp=3).validate_for(resolve_model("gpt3-1.3b"))


@pytest.mark.parametrize("argv, needle", [
    (["train", "--cp", "2", "--steps", "1"], "cp(2)=2 != world_size(1)"),
    (["train", "--cp", "3", "--seq", "60", "--compress", "gtopk", "--nproc", "3"], "gtopk"),
    (["simulate", "--model", "gpt3-1.3b", "--gpus", "6", "--cp", "3"], "2*cp"),
    (["simulate", "--model", "gpt3-1.3b", "--gpus", "6", "--cp", "4"], "--gpus"),
    (["simulate", "--model", "gpt3-1.3b", "--cp", "2", "--attention", "math"], "fused attention"),
    (["plan", "--model", "gpt3-1.3b", "--gpus", "8", "-b", "8", "--cp", "3", "--no-simulate"], "cp"),
])
def test_bad_cp_input_is_one_line_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_cp_in_a_config_file_is_read_by_train(capsys, tmp_path):
    """A plan's cp layout reaches train's checks: here the world size it needs, and a gTop-k group
    (dp x cp = 6) it cannot pair up, each one line before anything is written."""
    for parallel, extra, needle in (('{"dp": 1, "cp": 2}', [], "cp(2)=2 != world_size(1)"),
                                    ('{"dp": 3, "cp": 2, "compression": "gtopk"}', ["--nproc", "6"], "gtopk")):
        cfg = tmp_path / "run.json"
        cfg.write_text(f'{{"parallel": {parallel}, "model": "gpt-tiny"}}')
        with pytest.raises(SystemExit) as e:
            main(["train", "--config", str(cfg), "--steps", "1", *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and needle in err and len(err.splitlines()) == 1, err
        assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # nothing written
