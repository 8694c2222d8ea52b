"""The simulator against the closed forms of the schedule papers (uniform durations, free
communication): forward F = 1, backward B = 2 (split I = W = 1 for zero-bubble)."""

from __future__ import annotations

import pytest

from paratrain.schedule import generate
from paratrain.sim import simulate

PM = [(2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 32), (6, 12)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), PM)
def test_gpipe_and_1f1b_bubble(name: str, p: int, m: int) -> None:
    r = simulate(generate(name, stages=p, microbatches=m))
    # every rank computes 3m and waits (p-1)(F+B) (GPipe paper, Sec. 2.2; PipeDream-Flush)
    assert r.iteration_time_s == 3 * (m + p - 1)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)
    assert all(b == 3 * m for b in r.busy_s_by_rank)


@pytest.mark.parametrize(("p", "m"), PM)
def test_peak_inflight_gpipe_m_1f1b_p(p: int, m: int) -> None:
    assert simulate(generate("gpipe", stages=p, microbatches=m)).peak_inflight_by_rank == (m,) * p
    assert simulate(generate("1f1b", stages=p, microbatches=m)).peak_inflight_by_rank[0] == min(p, m)


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_interleaved_bubble(p: int, m: int, v: int) -> None:
    r = simulate(generate("interleaved", stages=p, microbatches=m, virtual_stages=v))
    # per-chunk durations 1 and 2: ideal 3vm, bubble (p-1)·3 (Narayanan et al., SC'21, Sec. 2.2)
    assert r.iteration_time_s == 3 * (v * m + p - 1)
    assert r.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)


@pytest.mark.parametrize(("p", "m"), PM)
def test_zb_h1_bubble_is_a_third_of_1f1b(p: int, m: int) -> None:
    r = simulate(generate("zb-h1", stages=p, microbatches=m))
    # Qi et al. (ICLR'24): bubble (p-1)(T_F + T_B - T_W) = p-1 with T_F = T_B = T_W = 1
    assert r.iteration_time_s == 3 * m + p - 1
    assert r.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1), rel=1e-12)
    ref = simulate(generate("1f1b", stages=p, microbatches=m))
    assert max(r.idle_s_by_rank) * 3 == pytest.approx(max(ref.idle_s_by_rank))
    # and 1F1B's activation memory: at most p micro-batches in flight
    assert max(r.peak_inflight_by_rank) == min(p, m)


@pytest.mark.parametrize(("d", "n"), [(2, 2), (4, 4), (4, 8), (6, 6), (6, 12), (8, 8), (8, 32)])
def test_chimera_bubble_and_memory(d: int, n: int) -> None:
    # Li & Hoefler (SC'21), Table 1: bubble ratio (D-2)/(2N+D-2), forward = backward = one slot
    r = simulate(generate("chimera", stages=d, microbatches=n), forward=1, backward=1)
    assert r.iteration_time_s == 2 * n + d - 2
    assert r.bubble_fraction == pytest.approx((d - 2) / (2 * n + d - 2), rel=1e-12)
    # activations between (D/2+1) and D micro-batches per rank (paper, Table 1)
    assert min(r.peak_inflight_by_rank) == d // 2 + 1
    assert max(r.peak_inflight_by_rank) == d


@pytest.mark.parametrize("name", ["2bw", "pipedream"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_async_steady_state_has_no_flush(name: str, p: int, m: int) -> None:
    s = generate(name, stages=p, microbatches=m, iterations=5)
    r = simulate(s)
    # no flush: in steady state every rank computes all the time, one batch per 3m
    assert r.iteration_time_s == pytest.approx(3 * m, rel=1e-12)
    assert r.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    expected = (2,) * p if name == "2bw" else tuple(p - r_ for r_ in range(p))
    assert r.weight_versions_by_rank == expected


def test_flush_schedules_cost_more_than_2bw() -> None:
    p, m = 4, 8
    two = simulate(generate("2bw", stages=p, microbatches=m)).iteration_time_s
    flush = simulate(generate("1f1b", stages=p, microbatches=m)).iteration_time_s
    assert flush - two == 3 * (p - 1)  # exactly the flush bubble
