"""ParallelConfig: mesh layout, derived sizes and validation against a model."""

from __future__ import annotations

import pytest

from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.model import preset


def test_default_layout_keeps_tp_innermost():
    c = ParallelConfig(dp=2, tp=4, pp=2, global_batch=16)
    assert c.world_size == 16
    assert c.group_ranks("tp")[0] == (0, 1, 2, 3)
    assert c.group_ranks("dp")[0] == (0, 4)
    assert c.group_ranks("pp")[0] == (0, 8)
    for r in range(16):
        assert c.rank_of(**c.coords_of(r)) == r


def test_layout_order_changes_groups():
    c = ParallelConfig(dp=2, tp=2, mesh_order=("pp", "tp", "dp"))
    assert c.group_ranks("dp")[0] == (0, 1)
    assert c.group_ranks("tp")[0] == (0, 2)


def test_microbatch_count_and_partition():
    c = ParallelConfig(dp=4, pp=2, microbatch=2, global_batch=64)
    assert c.num_microbatches == 8
    assert c.layers_per_chunk(7) == (4, 3)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dp=0), "dp"),
        (dict(dp=2, microbatch=3, global_batch=8), "global_batch"),
        (dict(virtual_stages=2), "virtual_stages"),
        (dict(schedule="zigzag"), "schedule"),
        (dict(pp=2, partition=(1,)), "partition"),
        (dict(mesh_order=("dp", "tp")), "mesh_order"),
    ],
)
def test_bad_configs_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        ParallelConfig(**kwargs)
    assert e.value.field == field


def test_validate_for_model():
    m = preset("gpt-tiny")  # 4 heads, 2 layers
    ParallelConfig(tp=4).validate_for(m)
    with pytest.raises(ConfigError, match="tp"):
        ParallelConfig(tp=3).validate_for(m)
    with pytest.raises(ConfigError, match="exceed"):
        ParallelConfig(pp=4).validate_for(m)
    with pytest.raises(ConfigError, match="sums to"):
        ParallelConfig(pp=2, partition=(1, 2)).validate_for(m)
    with pytest.raises(ConfigError, match="divide"):
        ParallelConfig(pp=2).validate_for(m.with_overrides(layers=3), even_layers=True)


def test_round_trip_dict():
    c = ParallelConfig(dp=2, tp=2, pp=2, schedule="interleaved", virtual_stages=2, global_batch=32, recompute="full")
    assert ParallelConfig.from_dict(c.to_dict()) == c
