"""Fitting the `cpu` device to measured runs (paratrain.sim.fit, `paratrain calibrate --from-trace`):
a trace made from the simulator's own timeline with every compute span 1.3 times as long must give a
speed factor of 1.3, and the fitted device must make the cost model's compute exactly that much slower."""

from __future__ import annotations

import dataclasses
import json

import pytest

from paratrain.parallel.config import ParallelConfig
from paratrain.sim import simulate_config
from paratrain.sim.fit import fit_trace, pooled_speed_factor, scaled_device
from paratrain.sim.trace import chrome_trace
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.device import DeviceSpec, cpu_calibration_path, resolve_device
from paratrain.spec.model import preset

SPEC = dataclasses.replace(preset("gpt-tiny"), layers=4)
CFG = ParallelConfig(pp=2, microbatch=2, global_batch=16, schedule="1f1b")


def _slower_trace(path, factor: float) -> float:
    """The simulated timeline with compute stretched by ``factor``, as a one-step measured trace;
    returns the simulated busy time summed over ranks."""
    cluster = resolve_cluster("cpu", "--cluster", gpus=2)
    sim = simulate_config(SPEC, cluster, CFG, record=True, optimizer="torch")
    events = [dataclasses.replace(e, duration_s=e.duration_s * factor) if e.stream == "compute" else e
              for e in sim.events]
    doc = chrome_trace(events)
    doc["metadata"] = {"microbatches": CFG.num_microbatches, "iterations": 1, "steps": 1,
                       "model_spec": SPEC.to_dict(), "parallel": CFG.to_dict()}
    path.write_text(json.dumps(doc))
    return sum(sim.busy_s_by_rank)


def test_speed_factor_of_a_stretched_timeline(tmp_path) -> None:
    busy = _slower_trace(tmp_path / "m.json", 1.3)
    fit = fit_trace(tmp_path / "m.json", resolve_device("cpu"))
    assert fit.simulated_busy_s == pytest.approx(busy, rel=1e-12)
    assert fit.speed_factor == pytest.approx(1.3, rel=1e-9)
    assert fit.duration_cv == pytest.approx(0.0, abs=1e-9)  # every forward of a chunk the same length
    assert pooled_speed_factor([fit, dataclasses.replace(fit, measured_busy_s=busy)]) == pytest.approx(1.15)


def test_scaled_device_stretches_every_compute_time_exactly() -> None:
    cluster = resolve_cluster("cpu", "--cluster", gpus=2)
    slow = dataclasses.replace(cluster, device=scaled_device(cluster.device, 1.3, duration_cv=0.0))
    base = simulate_config(SPEC, cluster, CFG, optimizer="torch")
    res = simulate_config(SPEC, slow, CFG, optimizer="torch")
    assert res.busy_s_by_rank == pytest.approx([1.3 * b for b in base.busy_s_by_rank], rel=1e-9)
    with pytest.raises(Exception, match="speed_factor"):
        scaled_device(cluster.device, 0.0)


def test_calibrate_from_trace_stores_the_fit(run_cli, tmp_path, monkeypatch) -> None:
    from tests.conftest import assert_one_line_error

    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    cpu_calibration_path().parent.mkdir(parents=True)
    before = resolve_device("cpu")
    _slower_trace(tmp_path / "m.json", 1.3)
    cpu_calibration_path().write_text(json.dumps(before.to_dict()))
    code, out, err = run_cli("calibrate", "--from-trace", str(tmp_path / "m.json"), "--json")
    assert code == 0, err
    assert json.loads(out)["speed_factor"] == pytest.approx(1.3, rel=1e-9)
    after = DeviceSpec(**json.loads(cpu_calibration_path().read_text()))
    assert after.peak_fp32_flops == pytest.approx(before.peak_fp32_flops / 1.3)
    assert after.kernel_overhead_s == pytest.approx(before.kernel_overhead_s * 1.3)
    assert after.gemm_efficiency == before.gemm_efficiency  # the rest is kept
    no_meta = tmp_path / "old.json"
    doc = json.loads((tmp_path / "m.json").read_text())
    del doc["metadata"]["model_spec"]
    no_meta.write_text(json.dumps(doc))
    code, _, err = run_cli("calibrate", "--from-trace", str(no_meta))
    assert_one_line_error(code, err, "--from-trace", "model_spec")
