"""The OSU-style communication report, from comm-log rows and from a simulated layout."""

from __future__ import annotations

import json

import pytest

from paratrain.errors import ConfigError
from paratrain.sim.characterize import (
    calls_from_rows,
    characterize,
    parse_jsonl,
    simulate_profile,
    step_time_from_metrics,
)


def _rows() -> list[dict]:
    """Two ranks, two steps: per step each rank all-reduces 1 MiB over dp (2 ms) and one of them
    sends (asynchronously) / the other receives 4 KiB over pp (0.5 ms); a simulator-style row
    names only a kind."""
    rows = []
    for step in (0, 1):
        for rank in (0, 1):
            rows.append({"kind": "all_reduce", "op": "all_reduce", "bytes": 2**20, "group": [0, 1], "start_s": 0.0,
                         "time_s": 2e-3, "backend": "gloo", "rank": rank, "axis": "dp", "step": step})
        rows.append({"kind": "p2p", "op": "send", "bytes": 4096, "time_s": 5e-4, "rank": 0, "axis": "pp",
                     "step": step, "async_op": True})
        rows.append({"kind": "p2p", "op": "recv", "bytes": 4096, "time_s": 5e-4, "rank": 1, "step": step})
    return rows


def test_measured_rows_give_per_rank_per_step_figures():
    calls, ranks, steps = calls_from_rows(_rows())
    assert (ranks, steps) == (2, 2)
    p = characterize(calls, ranks=ranks, steps=steps, step_time_s=0.01)
    # per rank per step: one all-reduce (1 MiB, 2 ms) and half of a send + half of a receive
    assert p.total.calls == pytest.approx(2.0)
    assert p.total.bytes == pytest.approx(2**20 + 4096)
    assert p.total.time_s == pytest.approx(2.5e-3)
    assert p.comm_share == pytest.approx(0.25)
    assert p.blocking_share == pytest.approx(0.225)  # the send was asynchronous
    assert p.by_op["all_reduce"].bytes == pytest.approx(2**20)
    assert p.by_op["send"].calls == pytest.approx(0.5) and p.by_op["recv"].calls == pytest.approx(0.5)
    assert set(p.by_axis) == {"dp", "pp"}  # the receive without an axis: pp from its kind
    assert p.by_axis["pp"].bytes == pytest.approx(4096)
    assert [(lo, s.calls) for lo, s in p.histogram] == [(4096, 1.0), (2**20, 1.0)]
    d = p.to_dict()
    assert d["comm_share_of_step"] == pytest.approx(0.25)
    assert d["size_histogram"][0] == {"min_bytes": 4096, "max_bytes": 8192, "calls": 1.0, "bytes": 4096.0,
                                      "time_s": pytest.approx(5e-4)}


def test_jsonl_and_metrics_parsing():
    text = "\n".join(json.dumps(r) for r in _rows()) + "\n\n"
    assert len(parse_jsonl(text, "--comm-log")) == 8
    metrics = [{"step": i, "step_time_s": t} for i, t in enumerate((0.9, 0.1, 0.12, 0.11))]
    assert step_time_from_metrics(metrics) == pytest.approx(0.115)  # the median: warm-up step left out


@pytest.mark.parametrize("text, needle", [
    ("", "empty"),
    ("{\"op\": \"all_reduce\"", "line 1 is not JSON"),
    ("[1, 2]", "not a JSON object"),
    ("{\"bytes\": 4, \"time_s\": 1}", "no 'op' or 'kind'"),
    ("{\"op\": \"send\", \"bytes\": -4, \"time_s\": 1}", "'bytes' must be a number"),
    ("{\"op\": \"send\", \"bytes\": 4}", "'time_s' must be a number"),
    ("{\"op\": \"send\", \"bytes\": 4, \"time_s\": 1, \"rank\": \"zero\"}", "'rank'"),
])
def test_malformed_logs_are_config_errors(text, needle):
    with pytest.raises(ConfigError, match=needle):
        calls_from_rows(parse_jsonl(text, "--comm-log"))


def test_metrics_without_step_times_are_a_config_error():
    with pytest.raises(ConfigError, match="step_time_s"):
        step_time_from_metrics([{"step": 0, "loss": 1.0}])


def test_simulated_layout_counts_what_the_layout_implies():
    """gpt3-1.3b, dp2 × tp2 × pp2, 4 micro-batches of 1 on dgx-a100 (Megatron-style TP): counted
    independently from the layout."""
    from paratrain.cost.stage import chunk_costs
    from paratrain.parallel.config import ParallelConfig
    from paratrain.spec.cluster import resolve_cluster
    from paratrain.spec.model import resolve_model

    model = resolve_model("gpt3-1.3b", "m")
    cluster = resolve_cluster("dgx-a100", "c", gpus=8)
    assert cluster.tensor_parallel == "megatron"
    cfg = ParallelConfig(dp=2, tp=2, pp=2, microbatch=1, global_batch=8)
    m, pp, layers = 4, 2, model.layers
    p = simulate_profile(model, cluster, cfg)
    assert (p.ranks, p.steps) == (pp, 1)
    act = 1 * model.seq * model.hidden * 2  # bf16 activation of one micro-batch
    # pp: each of the m micro-batches crosses the one boundary forward and backward: 2m transfers,
    # each a send on one rank and a receive on the other, of a tensor-parallel rank's 1/tp slice
    # (Megatron's scatter/gather; the all-gather on arrival is part of the transfer's time)
    assert p.by_axis["pp"].calls == pytest.approx(2 * 2 * m * (pp - 1) / pp)
    assert p.by_axis["pp"].bytes == pytest.approx(2 * 2 * m * (pp - 1) * act / 2 / pp)
    # tp per micro-batch: 2 + 2 all-reduces per layer (Megatron), 1 for the embedding's output,
    # the loss's 3 scalars per token and the head's input gradient
    assert p.by_axis["tp"].calls == pytest.approx(m * (4 * layers + 1 + 3 + 1) / pp)
    # dp: every chunk's gradients all-reduced once per step; the grad-norm scalar over the stages
    grads = sum(c.grad_reduce_bytes for c in chunk_costs(model, cluster, cfg))
    assert p.by_axis["dp"].bytes == pytest.approx(grads / pp)
    assert p.by_axis["none"].bytes == pytest.approx(4)
    # the views add up to the total
    for view in (p.by_op, p.by_axis, dict(p.histogram)):
        assert sum(s.bytes for s in view.values()) == pytest.approx(p.total.bytes)
        assert sum(s.time_s for s in view.values()) == pytest.approx(p.total.time_s)
    assert 0 < p.comm_share < 1


def test_more_tensor_parallelism_moves_more_tp_volume_and_less_dp():
    from paratrain.parallel.config import ParallelConfig
    from paratrain.spec.cluster import resolve_cluster
    from paratrain.spec.model import resolve_model

    model = resolve_model("gpt3-1.3b", "m")
    cluster = resolve_cluster("dgx-a100", "c", gpus=16)
    a = simulate_profile(model, cluster, ParallelConfig(dp=8, tp=2, pp=1, microbatch=1, global_batch=32))
    b = simulate_profile(model, cluster, ParallelConfig(dp=2, tp=8, pp=1, microbatch=1, global_batch=32))
    # same tokens per TP group member per micro-batch, 4x the micro-batches per replica
    assert b.by_axis["tp"].bytes == pytest.approx(4 * a.by_axis["tp"].bytes)
    assert b.by_axis["dp"].bytes < a.by_axis["dp"].bytes  # gradients sharded 8 ways instead of 2
