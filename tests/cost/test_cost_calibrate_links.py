"""`paratrain calibrate` links: the alpha-beta fit, the `cpu` cluster preset reading it, the
sustained-rate timer, and the command's input checks."""

from __future__ import annotations

import json
import time

import pytest
from tests.conftest import assert_one_line_error

from paratrain.cost.collectives import collective_time
from paratrain.runtime.calibrate_timing import mean_time
from paratrain.sim.fit_links import fit_alpha_beta
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.cluster_presets import cpu_cluster_calibration_path, cpu_links


def test_fit_recovers_an_exact_line() -> None:
    sizes = [4096.0, 65536.0, 262144.0, 1048576.0]
    times = [50e-6 + n / 2e9 for n in sizes]
    alpha, beta = fit_alpha_beta(sizes, times)
    assert alpha == pytest.approx(50e-6, rel=1e-9) and beta == pytest.approx(2e9, rel=1e-9)


def test_fit_least_squares_on_noisy_points() -> None:
    """Two points above and two below the line by the same amount, symmetric in size: the
    least-squares line is the line itself."""
    sizes = [1.0, 2.0, 3.0, 4.0]
    times = [10 + 1 + 0.5, 10 + 2 - 0.5, 10 + 3 - 0.5, 10 + 4 + 0.5]  # alpha 10, 1 byte per second
    alpha, beta = fit_alpha_beta(sizes, times)
    assert alpha == pytest.approx(10.0) and beta == pytest.approx(1.0)


def test_fit_clips_a_negative_latency_and_falls_back_on_a_flat_curve() -> None:
    sizes = [1e3, 1e6]
    alpha, beta = fit_alpha_beta(sizes, [1e-6, 2e-3])  # the line through both crosses below 0
    assert alpha == 0.0
    assert beta == pytest.approx(sum(x * x for x in sizes) / (1e3 * 1e-6 + 1e6 * 2e-3))
    alpha, beta = fit_alpha_beta(sizes, [3e-3, 2e-3])  # larger message faster: no slope
    assert alpha == 2e-3 and beta == pytest.approx(1e6 / 2e-3)
    with pytest.raises(ValueError):
        fit_alpha_beta([1.0], [1.0])


def test_cpu_cluster_reads_the_measured_link(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    assert cpu_links() is None
    default = resolve_cluster("cpu", gpus=2)
    cpu_cluster_calibration_path().write_text(json.dumps({"p2p_latency_s": 1.5e-3, "p2p_bandwidth_Bps": 2.5e9}))
    assert cpu_cluster_calibration_path() == tmp_path / "cpu-cluster.json"
    c = resolve_cluster("cpu", gpus=2)
    assert (c.intra_link.latency_s, c.intra_link.bandwidth_Bps) == (1.5e-3, 2.5e9)
    assert c.intra_link != default.intra_link
    n = 256 * 1024
    assert collective_time("p2p", n, (0, 1), c).time_s == pytest.approx(1.5e-3 + n / 2.5e9)
    cpu_cluster_calibration_path().write_text("{not json")
    assert resolve_cluster("cpu", gpus=2).intra_link == default.intra_link


def test_mean_time_counts_every_call_until_the_deadline() -> None:
    calls = []

    def fn() -> None:
        calls.append(1)
        time.sleep(0.002)

    t = mean_time(fn, repeats=1, deadline=time.perf_counter() - 1)
    assert len(calls) == 4  # warm-up + the three a mean needs at least
    assert t >= 0.002
    calls.clear()
    mean_time(fn, repeats=1, deadline=time.perf_counter() + 0.05)
    assert len(calls) >= 10  # runs until the deadline, whatever `repeats` says


@pytest.mark.parametrize("flag", ["--threads", "--procs"])
def test_bad_counts_are_one_line_errors(run_cli, tmp_path, monkeypatch, flag) -> None:
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    code, _, err = run_cli("calibrate", flag, "0")
    assert_one_line_error(code, err, flag)


@pytest.mark.slow
@pytest.mark.dist
def test_two_process_calibration_writes_device_and_links(run_cli, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    code, out, err = run_cli("calibrate", "--threads", "1", "--procs", "2", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["links_path"] == str(tmp_path / "cpu-cluster.json")
    links = json.loads((tmp_path / "cpu-cluster.json").read_text())
    assert 0 <= links["p2p_latency_s"] < 1.0 and 1e6 < links["p2p_bandwidth_Bps"] < 1e12
    assert len(links["p2p_s_by_bytes"]) == 5 and len(links["allreduce_s_by_bytes"]) == 4
    # the all-reduces over the one group of 2, 4 B to 32 MiB, also as rows the cluster reads
    rows = links["measured_reductions"]
    assert [(k, g, b) for k, g, b, _ in rows] == [("all_reduce", 2, int(b), ) for b in links["allreduce_s_by_bytes"]]
    assert [t for *_, t in rows] == list(links["allreduce_s_by_bytes"].values())
    assert links["measured_p2p"] == []  # two processes: none left to load the cores while they ping-pong
    assert doc["device"]["sm_count"] == 1
    c = resolve_cluster("cpu", gpus=2)
    assert c.measured_reductions == tuple(tuple(r) for r in rows)
    assert c.intra_link.latency_s == links["p2p_latency_s"]
    assert c.device.peak_fp32_flops == doc["device"]["peak_fp32_flops"]


def test_elementwise_rate_sets_the_memory_efficiency() -> None:
    from paratrain.runtime.calibrate import device_from_measurement

    m = {"peak_fp32_flops": 80e9, "memory_bandwidth_Bps": 12e9, "kernel_overhead_s": 3e-6, "threads": 1,
         "elementwise_Bps": 3e9}
    assert device_from_measurement(m).memory_efficiency == pytest.approx(0.25)
    assert device_from_measurement({**m, "elementwise_Bps": 20e9}).memory_efficiency == 1.0
    del m["elementwise_Bps"]
    assert device_from_measurement(m).memory_efficiency == 1.0


def test_links_document_fits_the_ping_pong() -> None:
    from paratrain.sim.fit_links import links_document

    p2p = {n: 20e-6 + n / 4e9 for n in (4096, 65536, 1048576)}
    doc = links_document(p2p, {4: 30e-6}, procs=2, threads=1)
    assert doc["p2p_latency_s"] == pytest.approx(20e-6, rel=1e-9)
    assert doc["p2p_bandwidth_Bps"] == pytest.approx(4e9, rel=1e-9)
    assert doc["p2p_s_by_bytes"] == {str(n): t for n, t in p2p.items()}
    assert doc["allreduce_s_by_bytes"] == {"4": 30e-6} and (doc["procs"], doc["threads"]) == (2, 1)


def test_measurement_reports_progress_in_order(monkeypatch) -> None:
    """Each measurement is announced before it runs, counted against the total the command's bar
    is sized to."""
    from paratrain.runtime import calibrate as cal

    monkeypatch.setattr(cal, "measure_variation", lambda: 0.05)
    seen: list[tuple[int, int, str]] = []
    m = cal.measure_cpu(0.05, progress=lambda d, t, w: seen.append((d, t, w)))
    assert [d for d, _, _ in seen] == list(range(cal.measurement_steps(1)))
    assert {t for _, t, _ in seen} == {cal.measurement_steps(1)}
    assert seen[0][2].startswith("fp32 GEMM") and seen[-1][2] == "duration variation"
    assert m["duration_cv"] == 0.05 and m["peak_fp32_flops"] > 0
    assert cal.measurement_steps(2) > cal.measurement_steps(1)
