"""The communication tuning table (paratrain comm tune's output, train --comm-table's input) and the
alpha-beta fit of the cost model's link to it."""

from __future__ import annotations

import json
import math

import pytest

from paratrain.errors import ConfigError
from paratrain.runtime.comm.table import (
    OPS,
    Choice,
    Measurement,
    TuningTable,
    choices_from_measurements,
    load_table,
    write_table,
)
from paratrain.runtime.comm.tune import (
    AlphaBeta,
    fit_alpha_beta,
    fit_alpha_beta_by_op,
    group_shapes,
    links_from_table,
    message_sizes,
    ring_coefficients,
)


def _table() -> TuningTable:
    """gloo wins small all-reduces, gloo_1t from 16 KiB; one group size measured (4)."""
    ms = []
    for s in (1024, 16384, 262144):
        ms.append(Measurement("all_reduce", "gloo", 4, s, 1e-4 + s * 1e-9))
        ms.append(Measurement("all_reduce", "gloo_1t", 4, s, 2e-4 + s * 0.3e-9))
    return TuningTable(tuple(ms), choices_from_measurements(ms), default_backend="gloo", world_size=4)


def test_choices_are_contiguous_bands_with_geometric_edges():
    t = _table()
    # 1 KiB: gloo (1.01e-4 < 2.003e-4); 16 KiB: gloo 1.16e-4 < 2.05e-4; 256 KiB: gloo 3.62e-4 > gloo_1t 2.79e-4
    assert t.choices == (
        Choice("all_reduce", 4, 0, math.isqrt(16384 * 262144) + 1, "gloo"),
        Choice("all_reduce", 4, math.isqrt(16384 * 262144) + 1, None, "gloo_1t"),
    )
    assert t.choose("all_reduce", 1, 4) == "gloo"
    assert t.choose("all_reduce", 65536, 4) == "gloo"  # the edge is 65537
    assert t.choose("all_reduce", 65537, 4) == "gloo_1t"
    assert t.choose("all_reduce", 10**12, 4) == "gloo_1t"  # past the last size: the last band
    # an unmeasured group size takes the nearest on a log scale; an untuned op: the default (None)
    assert t.choose("all_reduce", 10**6, 2) == "gloo_1t"
    assert t.choose("broadcast", 1024, 4) is None
    assert t.choose("barrier", 0, 4) is None


def test_the_default_is_kept_unless_another_backend_is_clearly_faster():
    ms = [Measurement("broadcast", "gloo", 2, 1024, 1.00), Measurement("broadcast", "gloo_1t", 2, 1024, 0.95),
          Measurement("broadcast", "gloo", 2, 4096, 1.00), Measurement("broadcast", "gloo_1t", 2, 4096, 0.85)]
    t = TuningTable(tuple(ms), choices_from_measurements(ms, "gloo", margin=0.10))
    assert (t.choose("broadcast", 1024, 2), t.choose("broadcast", 4096, 2)) == ("gloo", "gloo_1t")
    t = TuningTable(tuple(ms), choices_from_measurements(ms, "gloo", margin=0.0))
    assert t.choose("broadcast", 1024, 2) == "gloo_1t"


def test_send_and_recv_use_the_send_recv_entry():
    ms = [Measurement("send_recv", b, 2, s, t) for b, s, t in
          (("gloo", 1024, 2.0), ("gloo_1t", 1024, 1.0), ("gloo", 4096, 1.0), ("gloo_1t", 4096, 2.0))]
    t = TuningTable(tuple(ms), choices_from_measurements(ms))
    assert [t.choose(op, 1024, 2) for op in ("send", "recv", "isend", "p2p")] == ["gloo_1t"] * 4
    assert t.choose("send", 4096, 2) == "gloo"


def test_round_trip_through_the_file(tmp_path):
    t = _table()
    p = write_table(tmp_path / "t.json", t)
    back = load_table(p)
    assert back.to_dict() == t.to_dict()
    assert back.choose("all_reduce", 10**6, 4) == "gloo_1t"


def _bad(tmp_path, mutate) -> str:
    doc = _table().to_dict()
    mutate(doc)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    with pytest.raises(ConfigError) as e:
        load_table(p)
    return str(e.value)


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(format="something"), "not a tuning table"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d["choices"][0].update(backend="infiniband"), "unknown backend 'infiniband'"),
    (lambda d: d["measurements"][0].update(backend="ucc"), "unknown backend 'ucc'"),
    (lambda d: d.update(default_backend="tcp"), "unknown backend 'tcp'"),
    (lambda d: d["measurements"][0].update(op="gossip"), "unknown operation 'gossip'"),
    (lambda d: d["measurements"][0].update(time_s=-1), "finite time"),
    (lambda d: d["measurements"][0].update(time_s=float("nan")), "finite time"),
    (lambda d: d["measurements"][0].pop("bytes"), "missing key 'bytes'"),
    (lambda d: d["choices"][1].update(min_bytes=5), "overlap or leave a gap"),
    (lambda d: d["choices"][0].update(max_bytes=0, min_bytes=0), "empty band"),
    (lambda d: d.update(choices="all"), "wrong type"),
])
def test_malformed_tables_are_config_errors(tmp_path, mutate, needle):
    assert needle in _bad(tmp_path, mutate)


def test_unreadable_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_table(tmp_path / "missing.json")
    (tmp_path / "t.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable JSON table"):
        load_table(tmp_path / "t.json")


def test_sizes_and_group_shapes():
    assert message_sizes(1024, 2**28) == tuple(1024 * 4**k for k in range(10))  # 1 KiB .. 256 MiB
    assert message_sizes(1024, 4096, factor=2) == (1024, 2048, 4096)
    assert group_shapes(2) == (2,)
    assert group_shapes(8) == (8, 4, 2)
    assert group_shapes(6) == (6, 3)
    with pytest.raises(ConfigError):
        message_sizes(1024, 512)


@pytest.mark.parametrize("op, p", [(o, p) for o in OPS for p in (2, 3, 8) if o != "send_recv" or p == 2])
def test_ring_coefficients_are_the_cost_models_formulas(op, p):
    """An independent check: the cost model's own ring (and pairwise, direct) times on a
    one-node cluster whose link is (alpha, beta) equal c_alpha·alpha + c_beta·n/beta."""
    from paratrain.cost.collectives import collective_time
    from paratrain.spec.cluster import ClusterSpec, LinkSpec, Topology, TopologyKind
    from paratrain.spec.device_presets import DEVICE_PRESETS

    alpha, beta, n = 7e-6, 3e9, 2**20
    link = LinkSpec(bandwidth_Bps=beta, latency_s=alpha)
    cluster = ClusterSpec(name="t", device=DEVICE_PRESETS["cpu"], nodes=1, devices_per_node=8, intra_link=link,
                          inter_link=link, topology=Topology(kind=TopologyKind.SINGLE_SWITCH))
    kind, ranks, algo = {"send_recv": ("p2p", (0, 1), None), "all_to_all": ("all_to_all", tuple(range(p)), None)
                         }.get(op, (op, tuple(range(p)), "ring"))
    ca, cb = ring_coefficients(op, p)
    want = collective_time(kind, n, ranks, cluster, algo).time_s
    assert ca * alpha + cb * n / beta == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("op", OPS)
def test_fit_recovers_alpha_and_beta_from_the_formula(op):
    alpha, beta = 35e-6, 2.5e9
    groups = (2,) if op == "send_recv" else (2, 4, 8)
    pts = []
    for p in groups:
        ca, cb = ring_coefficients(op, p)
        pts += [(p, n, ca * alpha + cb * n / beta) for n in message_sizes(1024, 2**28)]
    a, b = fit_alpha_beta(op, pts)
    assert a == pytest.approx(alpha, rel=1e-9)
    assert b == pytest.approx(beta, rel=1e-9)


def test_fit_clips_a_negative_latency_and_keeps_a_positive_bandwidth():
    # times exactly proportional to bytes minus a constant: alpha would be negative
    pts = [(2, n, max(n / 1e9 - 1e-6, 1e-7)) for n in (1e4, 1e5, 1e6)]
    a, b = fit_alpha_beta("send_recv", pts)
    assert a == 0.0 and 0.9e9 < b < 1.1e9
    a, b = fit_alpha_beta("send_recv", [(2, 1024, 1e-4), (2, 4096, 1e-4)])  # flat: no bandwidth term
    assert b == pytest.approx(4096 / 1e-4)


def test_links_document_from_a_table_feeds_the_cost_model():
    """What ``paratrain calibrate --comm-table`` writes: the default backend's send/recv fit as the
    link, every fit kept, the tensor-parallel measurements of an earlier calibration kept."""
    alpha, beta = 40e-6, 1.5e9
    ms = [Measurement("send_recv", "gloo", 2, n, alpha + n / beta) for n in (1024, 65536, 2**22)]
    ms += [Measurement("all_reduce", "gloo", 2, n, 2 * alpha + n / beta) for n in (1024, 2**22)]
    t = TuningTable(tuple(ms), choices_from_measurements(ms), world_size=2, machine={"threads_per_proc": 1})
    doc = links_from_table(t, {"measured_collectives": [["all_reduce", 2, 1024, 1e-4]], "procs": 9})
    assert doc["p2p_latency_s"] == pytest.approx(alpha) and doc["p2p_bandwidth_Bps"] == pytest.approx(beta)
    assert doc["measured_collectives"] == [["all_reduce", 2, 1024, 1e-4]] and doc["procs"] == 2
    assert [f["op"] for f in doc["comm_fit"]] == ["all_reduce", "send_recv"]
    ab = AlphaBeta("all_reduce", "gloo", **{k: doc["comm_fit"][0][k] for k in ("latency_s", "bandwidth_Bps")},
                   points=2)
    assert ab.predict_s(2**22, 2) == pytest.approx(2 * alpha + 2**22 / beta)
    assert fit_alpha_beta_by_op(t)[1].latency_s == pytest.approx(alpha)
    with pytest.raises(ConfigError, match="no send_recv"):
        links_from_table(TuningTable(tuple(ms[3:]), ()))
