"""`paratrain calibrate`: the measured CPU device round-trips through the calibration file."""

from __future__ import annotations

import json

import pytest

from paratrain.runtime.calibrate import core_share, device_from_measurement
from paratrain.spec.device import DeviceSpec, cpu_calibration_path, resolve_device
from paratrain.spec.device_presets import DEVICE_PRESETS


def test_device_from_measurement_round_trips(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    m = {"peak_fp32_flops": 123e9, "memory_bandwidth_Bps": 7.5e9, "kernel_overhead_s": 3e-6, "threads": 3}
    dev = device_from_measurement(m)
    assert (dev.peak_fp32_flops, dev.memory_bandwidth_Bps, dev.sm_count) == (123e9, 7.5e9, 3)
    assert resolve_device("cpu") == DEVICE_PRESETS["cpu"]  # nothing calibrated yet
    cpu_calibration_path().write_text(json.dumps(dev.to_dict()))
    assert cpu_calibration_path().parent == tmp_path
    assert resolve_device("cpu") == dev


@pytest.mark.slow
def test_calibrate_command_writes_the_cpu_device(run_cli, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    code, out, err = run_cli("calibrate", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["path"] == str(tmp_path / "cpu.json")
    stored = DeviceSpec(**json.loads((tmp_path / "cpu.json").read_text()))
    assert resolve_device("cpu") == stored == DeviceSpec(**doc["device"])
    # the measuring processes shared the cores: the stored rate is per core (paratrain.sim.sharing)
    links = doc["links"]
    share = core_share(links["procs"], links["threads"], links["cores"]) if links.get("cores") else 1.0
    assert stored.peak_fp32_flops == pytest.approx(max(doc["gemm_flops_by_size"].values()) / share, rel=1e-12)
    assert 1e8 < stored.peak_fp32_flops < 1e14 and 1e8 < stored.memory_bandwidth_Bps < 1e13
    other = tmp_path / "sub" / "mine.json"
    code, out, err = run_cli("calibrate", "--out", str(other), "--procs", "1")  # the device alone: faster
    assert code == 0, err
    assert "GFLOP/s" in out and other.is_file()
    DeviceSpec(**json.loads(other.read_text()))


def test_duration_variation_is_measured_and_stored(tmp_path, monkeypatch) -> None:
    from paratrain.errors import ConfigError
    from paratrain.runtime.calibrate import measure_variation

    cv = measure_variation(budget_s=0.2)
    assert 0 <= cv < 1
    m = {"peak_fp32_flops": 1e11, "memory_bandwidth_Bps": 1e10, "kernel_overhead_s": 1e-6, "threads": 1,
         "duration_cv": 0.12}
    assert device_from_measurement(m).duration_cv == 0.12
    assert DEVICE_PRESETS["cpu"].duration_cv == 0 and DEVICE_PRESETS["h100"].duration_cv == 0
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="duration_cv"):
            DeviceSpec(**{**DEVICE_PRESETS["cpu"].to_dict(), "duration_cv": bad})


def _trace(path, durations_by_step: dict[int, list[float]]) -> None:
    events = []
    for step, ds in durations_by_step.items():
        for i, d in enumerate(ds):
            events.append({"ph": "X", "pid": 0, "tid": 0, "name": f"F{i}@c0", "cat": "forward", "ts": 0.0,
                           "dur": d * 1e6, "args": {"step": step, "microbatch": i}})
    path.write_text(json.dumps({"traceEvents": events, "metadata": {"iterations": 1, "microbatches": len(ds)}}))


def test_run_variation_leaves_out_the_first_step(tmp_path) -> None:
    """What --from-trace and paratrain compare take as a run's variation: step 0 (warm-up) is left
    out, so forwards of 1, 2, 3 s give sqrt(variance / mean²) = sqrt(1/6); 2, 2, 2 gives 0."""
    from paratrain.trace import read_trace as load_trace
    from paratrain.trace import run_variation

    one, two = tmp_path / "one.json", tmp_path / "two.json"
    _trace(one, {0: [9.0, 0.1, 5.0], 1: [1.0, 2.0, 3.0]})
    _trace(two, {0: [1.0, 1.0, 1.0], 1: [2.0, 2.0, 2.0]})
    spans, _ = load_trace(str(one), "trace")
    assert run_variation(spans, is_async=False) == pytest.approx((1 / 6) ** 0.5, rel=1e-9)
    assert run_variation(spans, is_async=True) > 0.5  # an asynchronous run keeps every span
    assert run_variation(load_trace(str(two), "trace")[0], is_async=False) == 0.0


def test_from_trace_needs_a_calibration_and_a_readable_trace(run_cli, tmp_path, monkeypatch) -> None:
    from tests.conftest import assert_one_line_error

    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    one = tmp_path / "one.json"
    _trace(one, {0: [1.0, 2.0, 3.0]})
    code, _, err = run_cli("calibrate", "--from-trace", str(one))
    assert_one_line_error(code, err, "--from-trace", "paratrain calibrate")
    cpu_calibration_path().write_text(json.dumps(DEVICE_PRESETS["cpu"].to_dict()))
    code, _, err = run_cli("calibrate", "--from-trace", str(tmp_path / "missing.json"))
    assert_one_line_error(code, err, "--from-trace", "does not exist")


def test_measurement_stops_at_its_deadline() -> None:
    """The command's < 10 s bound comes from deadlines, not from a fixed repeat count: past the
    deadline each measurement takes one warm-up and one timed call, whatever the load."""
    import time

    from paratrain.runtime.calibrate_timing import best_time

    calls = []
    t = best_time(lambda: calls.append(1), repeats=1000, deadline=time.perf_counter() - 1)
    assert len(calls) == 2 and t >= 0
    calls.clear()
    best_time(lambda: calls.append(1), repeats=5, deadline=time.perf_counter() + 60)
    assert len(calls) == 6


@pytest.mark.parametrize("procs", ["1", "2"])
def test_unwritable_out_fails_before_measuring(run_cli, tmp_path, monkeypatch, procs) -> None:
    """An output path that cannot be written is one error line, and nothing is measured first."""
    from tests.conftest import assert_one_line_error

    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    measured = []
    monkeypatch.setattr("paratrain.runtime.calibrate.measure_machine", lambda *a, **k: measured.append(a))
    code, _, err = run_cli("calibrate", "--procs", procs, "--out", str(blocker / "cpu.json"))
    assert_one_line_error(code, err, "--out")
    assert measured == []
