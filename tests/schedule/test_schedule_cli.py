"""``paratrain schedule show``: output, JSON keys, files, and one-line errors."""

from __future__ import annotations

import json

import pytest

from paratrain.cli import main


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_show_ascii_and_counts(capsys) -> None:
    code, out, _ = _run(["schedule", "show", "--schedule", "chimera", "--stages", "4", "--microbatches", "8"], capsys)
    assert code == 0
    assert "bubble fraction: 0.2000" in out  # 6 idle of 30 per rank with F=1, B=2
    assert "peak in-flight micro-batches by rank: 3 4 4 3" in out
    assert sum(line.startswith("rank ") for line in out.splitlines()) == 4  # one timeline row per rank


def test_show_json(capsys) -> None:
    code, out, _ = _run(["schedule", "show", "-s", "1f1b", "-p", "4", "-m", "8", "--json"], capsys)
    doc = json.loads(out)
    assert code == 0
    assert doc["bubble_fraction"] == pytest.approx(3 / 11)
    assert doc["iteration_time"] == 33
    assert doc["peak_inflight_by_rank"] == [4, 3, 2, 1]
    code, out, _ = _run(
        [
            "schedule",
            "show",
            "-s",
            "1f1b",
            "-p",
            "4",
            "-m",
            "8",
            "--json",
            "--forward-time",
            "2",
            "--backward-time",
            "4",
        ],
        capsys,
    )
    assert json.loads(out)["iteration_time"] == 33  # in units of one forward


def test_save_edit_and_load(tmp_path, capsys) -> None:
    path = tmp_path / "s.json"
    code, _, _ = _run(["schedule", "show", "-s", "gpipe", "-p", "2", "-m", "2", "--save", str(path)], capsys)
    assert code == 0
    code, out, _ = _run(["schedule", "show", "--file", str(path), "--json"], capsys)
    assert code == 0 and json.loads(out)["peak_inflight_by_rank"] == [2, 2]
    doc = json.loads(path.read_text())
    doc["actions"][1].remove("RF0@c1<0")
    path.write_text(json.dumps(doc))
    code, out, err = _run(["schedule", "show", "--file", str(path)], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "rank 1" in err and "missing receive" in err


def test_plot_and_trace(tmp_path, capsys) -> None:
    png, tr = tmp_path / "t.png", tmp_path / "t.json"
    code, _, _ = _run(["schedule", "show", "-s", "zb-h1", "--plot", str(png), "--trace", str(tr)], capsys)
    assert code == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    events = [e for e in json.loads(tr.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["name"][0] for e in events} == {"F", "I", "W"}


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["-s", "chimera", "-p", "3", "-m", "6"], "--stages: Chimera needs an even number"),
        (["-s", "chimera", "-p", "4", "-m", "6"], "--microbatches"),
        (["-s", "interleaved", "-p", "4", "-m", "6"], "--microbatches"),
        (["-s", "interleaved", "-p", "4", "-m", "8", "-v", "1"], "--virtual-stages"),
        (["-s", "bogus"], "unknown schedule"),
        (["-s", "1f1b", "--backward-time", "0"], "must be positive"),
        (["--file", "/nonexistent.json"], "does not exist"),
        ([], "no schedule given"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv: list[str], words: str, capsys) -> None:
    code, out, err = _run(["schedule", "show", *argv], capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["-s", "1f1b", "-p", "512", "-m", "4096"], "exceeds 16384"),
        (["-s", "interleaved", "-p", "64", "-m", "256", "-v", "2"], "exceeds 16384"),
        (["-s", "2bw", "-p", "64", "-m", "64", "--iterations", "8"], "steps(8)"),
        (["-s", "1f1b", "-p", "16", "-m", "64", "--plot", "x.png"], "--plot"),
    ],
)
def test_sizes_that_cannot_finish_in_seconds_are_refused_up_front(argv: list[str], words: str, capsys,
                                                                  tmp_path, monkeypatch) -> None:
    import time

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("paratrain.sim.limits.MAX_PLOT_EVENTS", 1500)  # the plot limit's mechanism, small
    t0 = time.perf_counter()
    code, out, err = _run(["schedule", "show", *argv], capsys)
    assert time.perf_counter() - t0 < 5
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and words in err and "Traceback" not in err, err
    assert not (tmp_path / "x.png").exists()


def test_the_largest_accepted_size_shows_in_seconds(capsys) -> None:
    import time

    t0 = time.perf_counter()
    code, out, _ = _run(["schedule", "show", "-s", "1f1b", "-p", "64", "-m", "256", "--json"], capsys)
    assert code == 0 and json.loads(out)["actions"] > 90_000
    assert time.perf_counter() - t0 < 15  # ~3 s on one core; generous for a loaded test machine


def test_a_medium_schedule_plots_in_seconds(tmp_path, capsys) -> None:
    import time

    png = tmp_path / "m.png"
    t0 = time.perf_counter()
    code, _, err = _run(["schedule", "show", "-s", "1f1b", "-p", "16", "-m", "64", "--plot", str(png)], capsys)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert time.perf_counter() - t0 < 15  # ~1 s here; generous for a loaded test machine


def test_a_huge_schedule_file_is_refused_before_parsing(tmp_path, capsys) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"stages": 2, "actions": [["F0@c0"] * 60_000, ["F0@c1"] * 60_000]}))
    code, out, err = _run(["schedule", "show", "--file", str(path)], capsys)
    assert code == 2 and err.count("\n") == 1 and "--file" in err and "120000 actions" in err, err


def test_output_paths_are_checked_before_work(tmp_path, capsys) -> None:
    for flag in ("--plot", "--trace", "--save"):
        code, out, err = _run(["schedule", "show", "-s", "1f1b", flag, str(tmp_path)], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and flag in err and "directory" in err, err


def test_trace_carries_metadata(tmp_path, capsys) -> None:
    tr = tmp_path / "t.json"
    code, _, _ = _run(["schedule", "show", "-s", "1f1b", "-p", "2", "-m", "4", "--trace", str(tr)], capsys)
    assert code == 0
    meta = json.loads(tr.read_text())["metadata"]
    assert (meta["schedule"], meta["stages"], meta["microbatches"], meta["iterations"]) == ("1f1b", 2, 4, 1)
