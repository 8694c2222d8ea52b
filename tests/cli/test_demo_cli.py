"""`paratrain demo`: commands echoed whole; every argument checked before the first step."""

from __future__ import annotations

import io
import shlex

from rich.console import Console


def test_echoed_command_is_one_line_at_any_width(capsys):
    """A 30-column console would wrap the echo; the demo prints it whole so it can be copied."""
    from paratrain.cli.demo import _run

    buf = io.StringIO()
    argv = ["cost", "--model", "gpt-tiny", "--device", "cpu", "--microbatch", "2", "--json"]
    _run(Console(file=buf, width=30, force_terminal=False), "step", argv)
    echoed = [line for line in buf.getvalue().splitlines() if line.startswith("$ paratrain")]
    assert echoed == ["$ paratrain " + shlex.join(argv)]
    assert len(echoed[0]) > 30
    capsys.readouterr()


def test_bad_steps_fail_before_any_file_is_written(tmp_path, capsys):
    from paratrain.cli import main

    out = tmp_path / "demo"
    try:
        main(["demo", "--steps", "0", "--out", str(out)])
        code = 0
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert not out.exists()
    assert "--steps" in capsys.readouterr().err
