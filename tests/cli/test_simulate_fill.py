"""``paratrain simulate --fill kfac`` and ``paratrain schedule show --fill kfac``: keys, files, bad input."""

from __future__ import annotations

import json

import pytest

from paratrain.cli import main
from paratrain.schedule.filled import FilledSchedule
from paratrain.schedule.validate import validate

BASE = ["simulate", "--model", "bert-base", "--seq", "128", "--pp", "4", "--gpus", "8", "--microbatch", "8",
        "--global-batch", "128"]


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_adds_utilization_and_refresh_and_keeps_bubble_fraction(capsys) -> None:
    code, out, _ = _run([*BASE, "--schedule", "1f1b", "--json"], capsys)
    assert code == 0
    plain = json.loads(out)
    code, out, _ = _run([*BASE, "--schedule", "1f1b", "--fill", "kfac", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert doc["bubble_fraction"] == plain["bubble_fraction"]  # idle time without fillers, as before
    assert doc["utilization_without_fillers"] == pytest.approx(1 - doc["bubble_fraction"])
    assert doc["utilization_with_fillers"] > doc["utilization_without_fillers"]
    filled = FilledSchedule.from_dict(doc["kfac_filled_schedule"])
    assert filled.refresh_steps == doc["kfac_refresh_steps"] >= 1
    for it in filled.iterations:
        validate(it)
    # dp=2: the factor all-reduce takes time on every rank
    reduce = [a.duration_s for it in filled.iterations for row in it.actions for a in row if a.tag == "kfac.reduce"]
    assert len(reduce) == 4 and min(reduce) > 0


@pytest.mark.slow  # draws a PNG
def test_plot_and_trace_show_the_fillers_over_the_cycle(tmp_path, capsys) -> None:
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    code, out, _ = _run([*BASE, "--schedule", "chimera", "--fill", "kfac", "--plot", str(png), "--trace",
                         str(trace)], capsys)
    assert code == 0 and "K-FAC in the bubbles" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    fillers = [e for e in events if e.get("name", "").startswith("X:kfac")]
    # the simulator splits curvature by layer group, as PipeFisher does: kfac.curv.<m>.<k>
    assert {e["name"].split("/")[0] for e in fillers} >= {"X:kfac.curv.0.0", "X:kfac.reduce", "X:kfac.inv.0"}


def test_schedule_show_prints_the_filled_steps(capsys) -> None:
    code, out, _ = _run(["schedule", "show", "--schedule", "gpipe", "--stages", "2", "--microbatches", "1",
                         "--fill", "kfac"], capsys)
    assert code == 0
    assert "step 1 of the cycle:" in out and "X:kfac.reduce/0.5" in out


@pytest.mark.parametrize("argv, needle", [
    ([*BASE, "--schedule", "1f1b", "--fill", "adam"], "--fill: unknown filler work 'adam'"),
    ([*BASE, "--schedule", "pipedream", "--fill", "kfac"], "asynchronous"),
    ([*BASE[:-4], "--gpus", "8", "--tp", "2", "--microbatch", "8", "--global-batch", "64", "--fill", "kfac"],
     "--tp: K-FAC bubble filling models whole layers"),
    ([*BASE, "--fill", "kfac", "--kfac-inversion", "svd"], "--kfac-inversion: unknown method"),
    (["schedule", "show", "--schedule", "2bw", "--fill", "kfac"], "asynchronous"),
])
def test_bad_input_is_one_line_exit_2(argv: list[str], needle: str, capsys) -> None:
    code, out, err = _run(argv, capsys)
    assert code == 2
    assert needle in err and len(err.strip().splitlines()) == 1
