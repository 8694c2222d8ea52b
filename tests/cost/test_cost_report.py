"""`paratrain.cost.report`: the operator rows and per-layer totals agree with the closed forms,
and `paratrain cost --json` prints exactly the report."""

from __future__ import annotations

import json

import pytest

from paratrain.cost.flops import model_flops_per_iteration
from paratrain.cost.report import cost_report
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import preset

CLUSTER = resolve_cluster("dgx-a100", gpus=8)


@pytest.mark.parametrize(("name", "tp", "mb"), [("gpt2", 1, 1), ("llama3-8b", 2, 2), ("gpt3-175b", 8, 1)])
def test_operator_matmuls_add_up_to_the_model_flops(name: str, tp: int, mb: int) -> None:
    m = preset(name)
    rep = cost_report(m, CLUSTER, ParallelConfig(tp=tp, microbatch=mb, dtype=m.dtype))
    parts = [r.part for r in rep.ops]
    assert parts == sorted(parts, key=["embedding", "layer", "head"].index)
    assert {r.count for r in rep.ops if r.part == "layer"} == {m.layers}
    assert {r.count for r in rep.ops if r.part != "layer"} == {1}
    # every rank holds 1/tp of each GEMM: the rows times tp make one micro-batch's model FLOPs
    head = sum(r.fwd_flops + r.bwd_flops for r in rep.ops if r.matmul and r.part != "layer")
    total = (m.layers * rep.per_layer.matmul_flops + head) * tp / mb
    assert total == pytest.approx(model_flops_per_iteration(m, 1), rel=1e-5)
    assert rep.per_layer.fwd_flops > 0 and rep.per_layer.bwd_flops >= rep.per_layer.fwd_flops


def test_sequence_parallel_is_reported_as_asked() -> None:
    m = preset("gpt2")
    cfg = ParallelConfig(tp=1, microbatch=1, dtype=m.dtype, sequence_parallel=True)
    assert not cfg.sequence_parallel  # the config drops it at tp = 1
    assert cost_report(m, CLUSTER, cfg, sequence_parallel=True).sequence_parallel
    assert not cost_report(m, CLUSTER, cfg).sequence_parallel


def test_cli_json_is_the_report(run_cli) -> None:
    args = ["--model", "llama3-8b", "--tp", "2", "--microbatch", "2", "--recompute", "selective", "--fused"]
    code, out, err = run_cli("cost", *args, "--json")
    assert code == 0, err
    m = preset("llama3-8b")
    cfg = ParallelConfig(tp=2, microbatch=2, recompute="selective", dtype=m.dtype)
    rep = cost_report(m, CLUSTER.resized(nodes=1), cfg, fused=True, sequence_parallel=False)
    assert json.loads(out) == json.loads(json.dumps(rep.to_dict()))
