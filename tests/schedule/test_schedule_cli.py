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
