"""``paratrain plot``: loss curves of several runs from their metrics files, a JSON summary, and
bad input (empty, not JSON, no loss, the output on an input) as one line with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.cli import main


def _rows(losses: list[float], evals: dict[int, float], tokens_per_step: int, *, with_tokens: bool) -> str:
    out = []
    for step, loss in enumerate(losses):
        row = {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.5,
               "tokens_per_s": tokens_per_step / 0.5, "rank": 0}
        if with_tokens:
            row["tokens"] = (step + 1) * tokens_per_step
        if step in evals:
            row.update(eval_loss=evals[step], eval_ppl=2.718281828 ** evals[step])
        out.append(json.dumps(row))
    return "\n".join(out) + "\n"


def _run(argv: list[str]) -> int:
    try:
        main(argv)
        return 0
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.slow  # matplotlib's import and two PNGs: seconds
def test_two_runs_overlaid_with_a_summary(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a, b = tmp_path / "lr-high.jsonl", tmp_path / "lr-low.jsonl"
    a.write_text(_rows([5.0, 4.0, 3.5, 3.0], {1: 4.2, 3: 3.4}, 256, with_tokens=True))
    # an older file without the tokens key: tokens from tokens_per_s * step_time_s; a resumed step 1 twice
    b.write_text(_rows([5.0, 4.5, 4.4], {}, 512, with_tokens=False) + json.dumps({"step": 1, "loss": 4.6,
                 "tokens_per_s": 1024.0, "step_time_s": 0.5}) + "\n")
    out = tmp_path / "curves.png"
    capsys.readouterr()
    assert _run(["plot", str(a), str(b), "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    high, low = doc["runs"]
    assert high == {"label": "lr-high", "steps": 4, "last_step": 3, "tokens": 1024, "first_loss": 5.0,
                    "last_loss": 3.0, "min_loss": 3.0, "evals": 2, "last_eval_loss": 3.4, "min_eval_loss": 3.4}
    assert low["label"] == "lr-low" and low["steps"] == 3 and low["tokens"] == 3 * 512
    assert low["min_loss"] == 4.4 and low["evals"] == 0 and low["last_eval_loss"] is None
    assert _run(["plot", str(a), "--out", str(tmp_path / "one.png")]) == 0
    text = capsys.readouterr().out
    assert "lr-high: 4 steps, 1,024 tokens, loss 5.0000 -> 3.0000, eval loss 3.4000 (2 evals)" in text


@pytest.mark.parametrize("content, needle", [
    ("", "holds no metrics rows"),
    ("not json\n", ":1 is not JSON"),
    ('{"step": 0}\n', "no integer 'step' and number 'loss'"),
], ids=["empty", "not-json", "no-loss"])
def test_bad_metrics_file_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             content: str, needle: str) -> None:
    f = tmp_path / "m.jsonl"
    f.write_text(content)
    capsys.readouterr()
    assert _run(["plot", str(f), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "fix:" in err[0], err
    assert not (tmp_path / "c.png").exists()


def test_output_on_an_input_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "m.jsonl"
    f.write_text(_rows([1.0], {}, 8, with_tokens=True))
    before = f.read_text()
    assert _run(["plot", str(f), "--out", str(f)]) == 2
    assert "would destroy it" in capsys.readouterr().err and f.read_text() == before
