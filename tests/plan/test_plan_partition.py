"""The balancing partitioners: PipeDream's DP is the reference, the bisection solver must agree."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.plan.partition import LayerCost, partition_dp, partition_fast, stage_costs


def _brute(layers, stages, budget, inflight):
    """Every split of the layer list into `stages` non-empty contiguous stages."""
    best = None
    n = len(layers)
    for cuts in itertools.combinations(range(1, n), stages - 1):
        split = [b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True)]
        part = stage_costs(layers, split, inflight)
        if budget is not None and any(m > budget for m in part.stage_memory_bytes):
            continue
        if best is None or part.bottleneck_s < best:
            best = part.bottleneck_s
    return best


layer_lists = st.lists(
    st.builds(LayerCost, st.floats(0.1, 10.0), st.floats(0.0, 5.0), st.floats(0.0, 3.0)), min_size=1, max_size=9
)


@settings(max_examples=150, deadline=None)
@given(layers=layer_lists, stages=st.integers(1, 5), budget=st.one_of(st.none(), st.floats(2.0, 40.0)))
def test_dp_and_fast_reach_the_brute_force_optimum(layers, stages, budget):
    inflight = [float(stages - s) for s in range(stages)]  # 1F1B: stage s holds p - s micro-batches
    want = _brute(layers, stages, budget, inflight) if stages <= len(layers) else None
    dp = partition_dp(layers, stages, memory_budget_bytes=budget, inflight=inflight)
    fast = partition_fast(layers, stages, memory_budget_bytes=budget, inflight=inflight)
    if want is None:
        assert dp is None and fast is None
        return
    assert dp is not None and fast is not None
    assert dp.bottleneck_s == pytest.approx(want, rel=1e-9)
    assert fast.bottleneck_s == pytest.approx(want, rel=1e-9)
    for part in (dp, fast):
        assert sum(part.layers) == len(layers) and min(part.layers) >= 1
        if budget is not None:
            assert max(part.stage_memory_bytes) <= budget * (1 + 1e-12)


def test_heavy_ends_get_fewer_layers():
    # Embedding and LM head make the first and last units heavy (end stages of a GPT).
    layers = [LayerCost(4.0)] + [LayerCost(1.0)] * 14 + [LayerCost(5.0)]
    part = partition_dp(layers, 4)
    assert part is not None
    assert part.layers[0] < 4 and part.layers[-1] < 4
    assert part.bottleneck_s == _brute(layers, 4, None, [1.0] * 4) == 6.0  # e.g. 4+1+1 | 6×1 | 6×1 | 1+5
    assert part.bottleneck_s == partition_fast(layers, 4).bottleneck_s


def test_memory_budget_moves_layers_off_the_first_stage():
    # Activations held p - s times: the first stage cannot keep as many layers as time alone wants.
    layers = [LayerCost(1.0, static_bytes=1.0, activation_bytes=1.0)] * 8
    free = partition_dp(layers, 2, inflight=[2.0, 1.0])
    tight = partition_dp(layers, 2, memory_budget_bytes=10.0, inflight=[2.0, 1.0])
    assert free is not None and tight is not None
    assert free.layers == (4, 4)
    assert tight.layers == (3, 5) and tight.stage_memory_bytes == (9.0, 10.0)
    assert partition_dp(layers, 2, memory_budget_bytes=5.0, inflight=[2.0, 1.0]) is None
    assert partition_fast(layers, 2, memory_budget_bytes=5.0, inflight=[2.0, 1.0]) is None


def test_long_lists_use_the_numeric_bisection_and_match_the_dp():
    layers = [LayerCost(1.0 + (i % 7) * 0.3, 1.0, 0.5) for i in range(170)]
    dp = partition_dp(layers, 8, memory_budget_bytes=60.0, inflight=[8 - s for s in range(8)])
    fast = partition_fast(layers, 8, memory_budget_bytes=60.0, inflight=[8 - s for s in range(8)])
    assert dp is not None and fast is not None
    assert fast.bottleneck_s == pytest.approx(dp.bottleneck_s, rel=1e-9)
