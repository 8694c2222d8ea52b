"""``paratrain compare``: the statistics of a timeline against closed forms and the simulator's own
report, the side-by-side output, the PNG, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.conftest import assert_one_line_error

from paratrain.schedule.registry import generate
from paratrain.sim import simulate
from paratrain.sim.trace import chrome_trace


def _write_sim_trace(path: Path, name: str, p: int, m: int, **kw) -> object:
    sched = generate(name, stages=p, microbatches=m, **kw)
    res = simulate(sched, forward=1.0, backward=2.0)
    # seconds as trace microseconds: keep the unit (durations 1 and 2 "seconds")
    path.write_text(json.dumps(chrome_trace(res.events)))
    return res


@pytest.mark.parametrize(("p", "m"), [(4, 8), (2, 4), (3, 5)])
def test_gpipe_bubble_matches_the_closed_form(tmp_path: Path, run_cli, p: int, m: int) -> None:
    trace = tmp_path / "g.json"
    _write_sim_trace(trace, "gpipe", p, m)
    code, out, err = run_cli("compare", str(trace), str(trace), "--json")
    assert code == 0, err
    doc = json.loads(out)
    # GPipe, uniform F=1, B=2, free communication: bubble (p-1)/(m+p-1), iteration 3(m+p-1)
    assert doc["measured"]["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)
    assert doc["measured"]["iteration_time_s"] == pytest.approx(3 * (m + p - 1), rel=1e-9)
    assert doc["measured"]["busy_s_by_rank"] == pytest.approx([3 * m] * p, rel=1e-9)
    assert doc["iteration_time_rel_error"] == 0
    assert doc["bubble_fraction_diff_points"] == 0


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "chimera", "pipedream", "2bw"])
def test_statistics_agree_with_the_simulator_report(tmp_path: Path, run_cli, name: str) -> None:
    trace = tmp_path / f"{name}.json"
    res = _write_sim_trace(trace, name, 4, 8)
    its = "4" if name in ("pipedream", "2bw") else "1"  # the generators' default for async schedules
    code, out, err = run_cli("compare", str(trace), str(trace), "--json", "--microbatches", "8",
                             "--iterations", its, "--sim-iterations", its)
    assert code == 0, err
    got = json.loads(out)["simulated"]
    assert got["bubble_fraction"] == pytest.approx(res.bubble_fraction, rel=1e-9)
    assert got["iteration_time_s"] == pytest.approx(res.iteration_time_s, rel=1e-9)
    assert got["busy_s_by_rank"] == pytest.approx(list(res.busy_s_by_rank), rel=1e-9)


def test_measured_step_selection_table_and_png(tmp_path: Path, run_cli) -> None:
    # A "measured" trace with two steps: step 1 is GPipe slowed down by 2x, shifted in time.
    sched = generate("gpipe", stages=2, microbatches=4)
    res = simulate(sched, forward=1.0, backward=2.0)
    doc = chrome_trace(res.events)
    events = []
    for step, (scale, offset) in enumerate([(1.0, 0.0), (2.0, 100.0)]):
        for e in doc["traceEvents"]:
            if e["ph"] == "X":
                events.append({**e, "ts": e["ts"] * scale + offset * 1e6, "dur": e["dur"] * scale,
                               "args": {**e["args"], "step": step}})
    measured = tmp_path / "m.json"
    measured.write_text(json.dumps({"traceEvents": events, "metadata": {"microbatches": 4, "iterations": 1}}))
    sim = tmp_path / "s.json"
    sim.write_text(json.dumps(doc))
    png = tmp_path / "both.png"
    code, out, err = run_cli("compare", str(measured), str(sim), "--plot", str(png))
    assert code == 0, err
    assert "(measured: step 1)" in out
    lines = {ln.split("  ")[0]: ln for ln in out.splitlines()}
    assert "-50.0%" in lines["iteration time (s)"]  # simulated is half the measured step 1
    assert "+0.0 pts" in lines["bubble fraction"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, _ = run_cli("compare", str(measured), str(sim), "--step", "0", "--json")
    assert json.loads(out)["iteration_time_rel_error"] == 0


def test_bad_input_is_one_line(tmp_path: Path, run_cli) -> None:
    good = tmp_path / "g.json"
    _write_sim_trace(good, "1f1b", 2, 2)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    assert_one_line_error(*run_cli("compare", str(tmp_path / "missing.json"), str(good))[::2], "MEASURED")
    assert_one_line_error(*run_cli("compare", str(good), str(bad))[::2], "SIMULATED", "not JSON")
    assert_one_line_error(*run_cli("compare", str(empty), str(good))[::2], "no compute events")
    # a trace without steps is compared whole, but has no step 7 to compare
    assert run_cli("compare", str(good), str(good))[0] == 0
    assert_one_line_error(*run_cli("compare", str(good), str(good), "--step", "7")[::2], "--step", "no steps",
                          "paratrain train --trace")
    code, _, err = run_cli("compare", str(good), str(good), "--iterations", "0")
    assert_one_line_error(code, err, "--iterations")


def test_duration_variation_pools_groups_of_the_same_action() -> None:
    """forward@c0 on rank 0 lasts 1, 2, 3 (variance/mean² = 1/6), backward@c0 2, 2, 2, 2 (0): the
    pooled value is sqrt((3/6 + 0) / 7); groups under three spans and U's parts are left out."""
    from paratrain.trace import TraceEvent, duration_variation

    def span(name: str, cat: str, d: float, rank: int = 0) -> TraceEvent:
        return TraceEvent(rank, "compute", name, 0.0, d, cat, None, 1)

    spans = [span(f"F{i}@c0", "forward", d) for i, d in enumerate((1.0, 2.0, 3.0))]
    spans += [span(f"B{i}@c0", "backward", 2.0) for i in range(4)]
    spans += [span("U.norm", "optimizer", d) for d in (1.0, 5.0, 9.0)]
    spans += [span("F0@c1", "forward", 1.0, rank=1), span("F1@c1", "forward", 9.0, rank=1)]
    assert duration_variation(spans) == pytest.approx((3 / 6 / 7) ** 0.5, rel=1e-12)
    assert duration_variation(spans[-2:]) is None


_EVENT = {"name": "F0@c0", "cat": "forward", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 1.0}


@pytest.mark.parametrize(
    ("event", "key"),
    [
        ({k: v for k, v in _EVENT.items() if k != "pid"}, "'pid'"),
        ({k: v for k, v in _EVENT.items() if k != "ts"}, "'ts'"),
        ({k: v for k, v in _EVENT.items() if k != "dur"}, "'dur'"),
        ({**_EVENT, "pid": "0"}, "'pid'"),
        ({**_EVENT, "ts": [0]}, "'ts'"),
        ({**_EVENT, "dur": "1"}, "'dur'"),
        ({**_EVENT, "args": {"step": "last"}}, "args.step"),
    ],
)
def test_malformed_events_are_one_line(tmp_path: Path, run_cli, event: dict, key: str) -> None:
    import time

    good = tmp_path / "g.json"
    _write_sim_trace(good, "1f1b", 2, 2)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"traceEvents": [_EVENT, event]}))
    t0 = time.perf_counter()
    assert_one_line_error(*run_cli("compare", str(bad), str(good))[::2], "MEASURED", "event 1", key)
    assert_one_line_error(*run_cli("compare", str(good), str(bad))[::2], "SIMULATED", "event 1", key)
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps({"traceEvents": [{**_EVENT, "ts": float("nan")}]}))  # Python writes NaN
    assert_one_line_error(*run_cli("compare", str(nan), str(good))[::2], "MEASURED", "NaN")
    assert time.perf_counter() - t0 < 5


def test_bad_metadata_and_plot_are_one_line(tmp_path: Path, run_cli, monkeypatch) -> None:
    good = tmp_path / "g.json"
    _write_sim_trace(good, "1f1b", 2, 2)
    doc = json.loads(good.read_text())
    doc["metadata"] = {"microbatches": "two"}
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps(doc))
    assert_one_line_error(*run_cli("compare", str(meta), str(good))[::2], "MEASURED", "microbatches")
    assert run_cli("compare", str(meta), str(good), "--microbatches", "2")[0] == 0
    # the output path is checked before any work; a timeline too big to draw is refused up front
    assert_one_line_error(*run_cli("compare", str(good), str(good), "--plot", str(tmp_path))[::2], "--plot")
    monkeypatch.setattr("paratrain.sim.limits.MAX_PLOT_EVENTS", 1500)  # the mechanism, on a small trace
    big = tmp_path / "big.json"
    _write_sim_trace(big, "gpipe", 8, 128)  # 2048 compute events
    png = tmp_path / "big.png"
    assert_one_line_error(*run_cli("compare", str(big), str(big), "--plot", str(png))[::2], "MEASURED", "1500")
    assert not png.exists()
