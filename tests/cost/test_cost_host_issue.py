"""Host-issue bound of a part's kernels and the Megatron cross-entropy byte count."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.cost.compute import head_ops, host_bound_time, layer_ops, op_kernels, op_time_split
from paratrain.cost.stage import chunk_costs, layer_cost
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig, Recompute
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.device import DeviceSpec, resolve_device
from paratrain.spec.model import preset

A100 = resolve_device("a100-80gb")
GPT = preset("gpt3-1.3b")


def _sums(ops: list, dev: DeviceSpec) -> tuple[float, float, int, int]:
    fwd = sum(op_time_split(o, dev, "fp16")[0] for o in ops)
    bwd = sum(sum(op_time_split(o, dev, "fp16")[1:]) for o in ops)
    n_fwd = sum(op_kernels(o)[0] for o in ops)
    n_bwd = sum(sum(op_kernels(o)[1:]) for o in ops)
    return fwd, bwd, n_fwd, n_bwd


def test_host_bound_is_the_max_of_device_and_host_time() -> None:
    dev = dataclasses.replace(A100, host_issue_s=10e-6)
    assert host_bound_time(1e-3, 50, dev) == pytest.approx(1e-3)  # 50 × 10 µs = 0.5 ms hidden
    assert host_bound_time(1e-4, 50, dev) == pytest.approx(5e-4)  # host-bound
    assert host_bound_time(1e-4, 50, A100) == pytest.approx(1e-4)  # presets: never host-bound


def test_kernel_counts_follow_the_roofline_terms() -> None:
    ops = {o.name: o for o in layer_ops(GPT, microbatch=1)}
    assert op_kernels(ops["fc1"]) == (1, 1, 1)  # forward, input gradient, weight gradient
    assert op_kernels(ops["attn_scores"]) == (1, 2, 0)  # two GEMMs, both input gradients
    assert op_kernels(ops["gelu"]) == (1, 2, 0)  # GeLU's backward and the fc1 bias gradient's reduction
    for o in ops.values():
        # A kernel for each non-zero roofline term of op_time_split.
        times = op_time_split(o, dataclasses.replace(A100, kernel_overhead_s=0.0), "fp16")
        kernels = op_kernels(o)
        assert [t > 0 for t in times[:1]] == [k > 0 for k in kernels[:1]]
        assert (times[2] > 0) == (kernels[2] > 0)


@pytest.mark.parametrize("microbatch", [1, 8])
def test_layer_is_device_bound_or_host_bound(microbatch: int) -> None:
    ops = layer_ops(GPT, microbatch=microbatch, fused=True)
    for issue in (0.0, 5e-6, 100e-6, 1e-3):
        dev = dataclasses.replace(A100, host_issue_s=issue)
        fwd, bwd, n_fwd, n_bwd = _sums(ops, dev)
        c = layer_cost(GPT, dev, "fp16", 1, False, microbatch, Recompute.NONE, True)
        assert c.forward_s == pytest.approx(max(fwd, n_fwd * issue), rel=1e-12)
        assert c.backward_input_s + c.backward_weight_s == pytest.approx(max(bwd, n_bwd * issue), rel=1e-12)
        # A host-bound backward keeps the device's split between input and weight gradients.
        dev0 = dataclasses.replace(A100, host_issue_s=0.0)
        c0 = layer_cost(GPT, dev0, "fp16", 1, False, microbatch, Recompute.NONE, True)
        assert c.backward_weight_s / c.backward_input_s == pytest.approx(
            c0.backward_weight_s / c0.backward_input_s, rel=1e-12
        )


def test_host_issue_slows_small_microbatches_more() -> None:
    cluster = resolve_cluster("dgx-a100", nodes=1)
    slow_host = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, host_issue_s=30e-6))
    ratio = {}
    for mb in (1, 16):
        cfg = ParallelConfig(microbatch=mb, dtype="fp16")
        (fast,) = chunk_costs(GPT, cluster, cfg)
        (slow,) = chunk_costs(GPT, slow_host, cfg)
        ratio[mb] = slow.forward_s / fast.forward_s
    assert ratio[1] > ratio[16] >= 1.0


def test_megatron_cross_entropy_bytes() -> None:
    # Independent count over Megatron-LM's _VocabParallelCrossEntropy on fp32 logits, bytes per
    # logit: cast 2+4, max 4, subtract 4+4, exp 4+4, sum 4, divide 4+4; backward mul 4+4, cast 4+2.
    for tp in (1, 4):
        (*_, loss) = head_ops(GPT, tp=tp, microbatch=2, dtype="fp16")
        logits = 2 * GPT.seq * -(-GPT.vocab // tp)
        assert loss.fwd_bytes == logits * (2 + 4 + 4 + 8 + 8 + 4 + 8)
        assert loss.bwd_bytes == logits * (8 + 4 + 2)
        assert op_kernels(loss) == (6, 2, 0)


def test_negative_host_issue_is_rejected() -> None:
    with pytest.raises(ConfigError, match="host_issue_s"):
        dataclasses.replace(A100, host_issue_s=-1e-6)
