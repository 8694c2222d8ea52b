"""Library errors about the cluster's size name fields, never a command's flags (the CLI maps
fields to its flags)."""

from __future__ import annotations

import pytest

from paratrain.cost.collectives import collective_time
from paratrain.cost.stage import chunk_costs
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.sim import simulate_config
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import preset

MODEL = preset("gpt2")
SMALL = resolve_cluster("dgx-a100", gpus=4)


def test_simulate_config_too_many_ranks_names_the_cluster_field() -> None:
    cfg = ParallelConfig(dp=2, tp=2, pp=2, microbatch=1, global_batch=8)
    with pytest.raises(ConfigError) as e:
        simulate_config(MODEL, SMALL, cfg)
    assert e.value.field == "cluster.gpus"
    assert "--" not in str(e.value)


def test_cost_errors_outside_the_cluster_name_no_flags() -> None:
    with pytest.raises(ConfigError) as e:
        chunk_costs(MODEL, SMALL, ParallelConfig(dp=1, tp=8, pp=1, microbatch=1, global_batch=8))
    assert e.value.field == "tp" and "--" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        collective_time("all_reduce", 1e6, [0, 7], SMALL)
    assert e.value.field == "ranks" and "--" not in str(e.value)
