"""How ``paratrain calibrate`` turns a parallelized block's added time into per-collective rows
(``runtime.calibrate_tp.per_collective``), and back: the cost model then charges a layer of the
block's shape what the block measured. Pure arithmetic on the cost model's own counts (the counts
themselves are checked against a recording of DTensor in tests/runtime/test_calibrate_tp.py)."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest

from paratrain.cost.tensor_parallel import fit_line, tp_part_cpu, tp_part_times, tp_parts
from paratrain.runtime.calibrate_tp import BLOCK_SHAPES, _block_spec, block_part, per_collective
from paratrain.spec.cluster import resolve_cluster

D = 7e-4  # dispatch per module, forward and backward together


def _layer(sp: bool, g: int = 2, shape: tuple[int, int, int] = BLOCK_SHAPES[-1]):
    hidden, seq, batch = shape
    return tp_parts(_block_spec(g, hidden, seq), sequence_parallel=sp, microbatch=batch, dtype="fp32")["layer"]


@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_a_block_without_sequence_parallelism_splits_evenly_over_its_all_reduces(rate: float) -> None:
    layer = _layer(False)
    # 8 modules (q, k, v, o, fc1, fc2 and the two shared inputs), 2 all-reduces forward and 2
    # backward: 4 a + 8 D / r
    assert layer.modules == 8 and sum(c.count for c in (*layer.forward, *layer.backward)) == 4
    added = 8 * D / rate + 4 * 2.5e-3
    assert per_collective(added, layer, D, rate, lambda n: None) == pytest.approx(2.5e-3, rel=1e-12)


def test_a_block_with_sequence_parallelism_splits_evenly_over_its_gathers_and_scatters() -> None:
    h, seq, batch = BLOCK_SHAPES[-1]
    act = batch * seq * h * 4
    part = block_part(_block_spec(2, h, seq), True, batch)

    def line(n: int) -> float:
        return 1e-3 + n * 1e-9

    # forward 2 all-gathers + 2 reduce-scatters, backward 2 reduce-scatters (the shared inputs'
    # summed gradients) + 2 all-gathers, no all-reduce of the activation; the layer's
    # norm-gradient all-reduces (one per norm parameter tensor) are the runtime's hooks', which the
    # bare block does not have
    assert sum(c.count for c in part.forward) == 4
    assert sorted((c.kind, c.nbytes, c.count) for c in part.backward) == [("all_gather", act, 2),
                                                                         ("reduce_scatter", act, 2)]
    layer = _layer(True)
    assert sorted((c.nbytes, c.count) for c in layer.backward if c.kind == "all_reduce") == [(h * 4, 4)]
    assert part.modules == layer.modules and part.forward == layer.forward
    y = 1.7e-3
    added = part.modules * D + 8 * y
    assert per_collective(added, part, D, 1.0, line) == pytest.approx(y, rel=1e-9)


def test_a_block_cheaper_than_its_dispatch_gives_no_negative_collective() -> None:
    assert per_collective(1e-3, _layer(False), D, 1.0, lambda n: None) == 0.0


def test_the_blocks_split_evenly_and_move_2_KiB_64_KiB_and_512_KiB() -> None:
    for g in (2, 4, 8, 3, 6):
        for hidden, seq, _batch in BLOCK_SHAPES:
            spec = _block_spec(g, hidden, seq)
            assert spec.heads % g == 0 and spec.hidden % spec.heads == 0 and spec.hidden >= hidden
            assert spec.seq % g == 0 and spec.seq >= seq
    assert [b * s * h * 4 for h, s, b in BLOCK_SHAPES] == [2 * 2**10, 64 * 2**10, 512 * 2**10]


def test_the_cost_model_charges_a_layer_of_the_block_what_the_block_measured() -> None:
    """Rows from per_collective at every block shape, fed to the cluster: the layer's collectives
    plus dispatch come back as the block's added time (one group with a core each: r = 1) and
    its host work as the added CPU."""
    dev = dataclasses.replace(resolve_cluster("cpu").device, tp_dispatch_forward_s=2e-4, tp_dispatch_backward_s=5e-4)
    times, cpus, added = [], [], {}
    for hidden, seq, batch in BLOCK_SHAPES:
        layer = _layer(False, 2, (hidden, seq, batch))
        act = batch * seq * hidden * 4
        wall, cpu = 9e-3 + act * 2e-8, 6e-3 + act * 1e-8  # added over the local work: lines in bytes
        added[(hidden, seq, batch)] = (layer, wall, cpu)
        times.append(("all_reduce", 2, act, per_collective(wall, layer, 7e-4, 1.0, lambda n: None)))
        cpus.append(("all_reduce", 2, act, per_collective(cpu, layer, 7e-4, 1.0, lambda n: None)))
    cluster = dataclasses.replace(resolve_cluster("cpu", gpus=2), device=dev, measured_collectives=tuple(times),
                                  collective_cpu_s=tuple(cpus), tensor_parallel="dtensor", cores_per_node=2,
                                  threads_per_process=1)
    for layer, wall, cpu in added.values():
        cf, cb, df, db = tp_part_times(layer, cluster, (0, 1))
        assert cf + cb + df + db == pytest.approx(wall, rel=1e-9)
        wf, wb = tp_part_cpu(layer, cluster, (0, 1))
        assert wf + wb + df + db == pytest.approx(cpu, rel=1e-9)


def test_with_sequence_parallelism_the_model_adds_the_norm_gradients_to_what_the_block_measured() -> None:
    """Rows from both blocks at every shape: a layer with sequence parallelism is charged what its
    block measured plus its norms' gradient all-reduces at the all-reduce line (the hooks' work in
    a training step, absent from the bare block)."""
    dev = dataclasses.replace(resolve_cluster("cpu").device, tp_dispatch_forward_s=2e-4, tp_dispatch_backward_s=5e-4)
    d = 7e-4
    rows: list = []
    added = {}
    for sp in (False, True):
        for hidden, seq, batch in BLOCK_SHAPES:
            spec = _block_spec(2, hidden, seq)
            part = block_part(spec, sp, batch)
            act = batch * seq * hidden * 4
            wall = (9e-3 if not sp else 14e-3) + act * 2e-8
            per = per_collective(wall, part, d, 1.0, partial(fit_line, tuple(rows), "all_reduce", 2))
            added[(sp, hidden, seq, batch)] = wall
            rows += [(k, 2, act, per) for k in (("all_gather", "reduce_scatter") if sp else ("all_reduce",))]
    cluster = dataclasses.replace(resolve_cluster("cpu", gpus=2), device=dev, measured_collectives=tuple(rows),
                                  tensor_parallel="dtensor", cores_per_node=2, threads_per_process=1)
    for hidden, seq, batch in BLOCK_SHAPES:
        layer = _layer(True, 2, (hidden, seq, batch))
        norms = sum(c.count * fit_line(tuple(rows), "all_reduce", 2, c.nbytes)
                    for c in layer.backward if c.kind == "all_reduce" and c.nbytes == hidden * 4)
        cf, cb, df, db = tp_part_times(layer, cluster, (0, 1))
        assert cf + cb + df + db == pytest.approx(added[(True, hidden, seq, batch)] + norms, rel=1e-9)
