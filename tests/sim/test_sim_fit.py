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


def _rates_divided(device: DeviceSpec, f: float) -> DeviceSpec:
    """The fit as it was first done: every peak rate and the bandwidth divided by ``f``, overheads
    multiplied (each roofline time then scales by exactly ``f``)."""
    rates = ("peak_fp32_flops", "peak_bf16_flops", "peak_tf32_flops", "peak_fp16_flops", "peak_fp8_flops",
             "peak_int8_flops", "memory_bandwidth_Bps")
    changes = {k: getattr(device, k) / f for k in rates}
    changes.update(kernel_overhead_s=device.kernel_overhead_s * f, host_issue_s=device.host_issue_s * f)
    return dataclasses.replace(device, **changes)


@pytest.mark.parametrize("factor", [1.3, 2.0, 0.5])
@pytest.mark.parametrize("device", ["cpu", "a100-80gb"])
def test_fitted_speed_goes_into_the_efficiency_not_the_peak(factor: float, device: str) -> None:
    """Predicted times equal those of dividing every rate by the factor; the peak FLOP/s stay (unless
    the run beat what an efficiency of 1 allows: factor 0.5 below the presets' GEMM efficiency), so
    MFU is the old MFU divided by the factor."""
    cluster = dataclasses.replace(resolve_cluster("cpu", "--cluster", gpus=2), device=resolve_device(device))
    base = cluster.device
    new = scaled_device(base, factor, duration_cv=0.0)
    old = dataclasses.replace(_rates_divided(base, factor), duration_cv=0.0)
    got = simulate_config(SPEC, dataclasses.replace(cluster, device=new), CFG, optimizer="torch")
    want = simulate_config(SPEC, dataclasses.replace(cluster, device=old), CFG, optimizer="torch")
    assert got.iteration_time_s == pytest.approx(want.iteration_time_s, rel=1e-12)
    assert got.busy_s_by_rank == pytest.approx(want.busy_s_by_rank, rel=1e-12)
    if factor >= base.gemm_efficiency:
        assert new.peak_flops(CFG.dtype) == base.peak_flops(CFG.dtype)
        assert new.gemm_efficiency == pytest.approx(base.gemm_efficiency / factor, rel=1e-15)
        assert got.mfu == pytest.approx(want.mfu / factor, rel=1e-12)
    else:
        assert new.gemm_efficiency == 1.0
        assert new.peak_flops(CFG.dtype) == pytest.approx(base.peak_flops(CFG.dtype) * base.gemm_efficiency / factor)
    assert got.mfu <= 1


def _pp1_trace(path, *, factor: float, steps: int, with_steps: bool) -> float:
    """A measured data-parallel run without a pipeline (pp = 1, dp = 2), both ranks' spans as
    ``paratrain train --trace`` records them (pid = global rank), each compute span ``factor`` times
    the simulated one; with ``with_steps`` the spans carry ``args.step`` and step 0 (warm-up) is 5
    times slower still. Returns the simulated busy time of the one pipeline rank."""
    cfg = ParallelConfig(dp=2, pp=1, microbatch=2, global_batch=16)
    cluster = resolve_cluster("cpu", "--cluster", gpus=2)
    sim = simulate_config(SPEC, cluster, cfg, record=True, optimizer="torch")
    assert {e.rank for e in sim.events} == {0}
    it = sim.iteration_time_s * factor * 5
    events = []
    for step in range(steps):
        slow = factor * (5 if with_steps and step == 0 else 1)
        for rank in (0, 1):
            for e in sim.events:
                events.append(dataclasses.replace(
                    e, rank=rank, start_s=e.start_s * slow + step * it,
                    duration_s=e.duration_s * slow if e.stream == "compute" else e.duration_s,
                    step=step if with_steps else None))
    doc = chrome_trace(events)
    doc["metadata"] = {"microbatches": cfg.num_microbatches, "iterations": 1, "steps": steps,
                       "model_spec": SPEC.to_dict(), "parallel": cfg.to_dict()}
    path.write_text(json.dumps(doc))
    return sum(sim.busy_s_by_rank)


@pytest.mark.parametrize("with_steps", [False, True])
def test_a_pp1_trace_fits(tmp_path, with_steps: bool) -> None:
    busy = _pp1_trace(tmp_path / "dp.json", factor=1.3, steps=3, with_steps=with_steps)
    fit = fit_trace(tmp_path / "dp.json", resolve_device("cpu"))
    assert fit.simulated_busy_s == pytest.approx(busy, rel=1e-12)
    assert fit.speed_factor == pytest.approx(1.3, rel=1e-9)


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
    assert after.peak_fp32_flops == before.peak_fp32_flops  # the MFU denominator stays as measured
    assert after.gemm_efficiency == pytest.approx(before.gemm_efficiency / 1.3)
    assert after.memory_bandwidth_Bps == pytest.approx(before.memory_bandwidth_Bps / 1.3)
    assert after.kernel_overhead_s == pytest.approx(before.kernel_overhead_s * 1.3)
    assert after.memory_efficiency == before.memory_efficiency  # the rest is kept
    no_meta = tmp_path / "old.json"
    doc = json.loads((tmp_path / "m.json").read_text())
    del doc["metadata"]["model_spec"]
    no_meta.write_text(json.dumps(doc))
    code, _, err = run_cli("calibrate", "--from-trace", str(no_meta))
    assert_one_line_error(code, err, "--from-trace", "model_spec")
