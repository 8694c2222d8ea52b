"""The README quotes what the code prints: every block under ``<!-- regen -->`` is re-run here.

``python docs/regen.py`` rewrites the blocks; this test fails when one of them is stale.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


def _regen():
    return load_script("docs/regen.py", "paratrain_docs_regen")


def test_a_stale_block_is_detected_and_rewritten(tmp_path: Path) -> None:
    regen = _regen()
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- regen -->\n```\n$ echo one; echo two\nstale\n```\nafter\n")
    diff = regen.stale_diff(readme)
    assert "-stale" in diff and "+one" in diff and "+two" in diff
    readme.write_text(regen.regenerate(readme.read_text()))
    assert regen.stale_diff(readme) == ""
    assert readme.read_text() == "intro\n<!-- regen -->\n```\n$ echo one; echo two\none\ntwo\n```\nafter\n"


def test_search_time_is_masked(tmp_path: Path) -> None:
    regen = _regen()
    readme = tmp_path / "README.md"
    readme.write_text("<!-- regen -->\n```\n$ echo 'Top 5 (searched in 1.5 s)'\nTop 5 (searched in 9.9 s)\n```\n")
    assert regen.stale_diff(readme) == ""


def test_here_document_belongs_to_its_command(tmp_path: Path) -> None:
    regen = _regen()
    text = "<!-- regen -->\n```\n$ cat > a.txt <<'EOF'\nfirst\n$ not a command\nEOF\n$ cat a.txt\nstale\n```\n"
    out = regen.regenerate(text)
    assert out == (
        "<!-- regen -->\n```\n$ cat > a.txt <<'EOF'\nfirst\n$ not a command\nEOF\n"
        "$ cat a.txt\nfirst\n$ not a command\n```\n"
    )


def test_each_block_runs_in_its_own_scratch_directory() -> None:
    regen = _regen()
    block = "<!-- regen -->\n```\n$ ls; touch {}.txt\n```\n"
    text = block.format("a") + block.format("b")
    assert regen.regenerate(text) == text  # neither block sees the file the other made


def test_a_quoted_error_is_kept_but_an_unexpected_failure_stops(tmp_path: Path) -> None:
    regen = _regen()
    ok = regen.regenerate("<!-- regen -->\n```\n$ echo 'paratrain: error: x'; exit 2\n```\n")
    assert "paratrain: error: x" in ok
    for cmd in ("no-such-command-xyz", "echo hello | grep -q absent"):
        with pytest.raises(SystemExit, match="exited with"):
            regen.regenerate(f"<!-- regen -->\n```\n$ {cmd}\n```\n")


def test_file_option_checks_and_rewrites_another_file(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- regen -->\n```\n$ echo fresh\nstale\n```\n")
    script = [sys.executable, str(ROOT / "docs" / "regen.py"), "--file", str(doc)]
    check = subprocess.run([*script, "--check"], capture_output=True, text=True)
    assert check.returncode == 1 and "+fresh" in check.stdout
    assert subprocess.run(script, capture_output=True, text=True).returncode == 0
    assert doc.read_text() == "<!-- regen -->\n```\n$ echo fresh\nfresh\n```\n"
    assert subprocess.run([*script, "--check"], capture_output=True, text=True).returncode == 0


@pytest.mark.slow
def test_readme_figures_match_the_code() -> None:
    regen = _regen()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(regen.find_blocks(text.splitlines())) >= 5, "the README's quoted outputs should be regen blocks"
    diff = regen.stale_diff()
    assert diff == "", "README figures differ from what the code prints; run `python docs/regen.py`:\n" + diff[:6000]


def test_the_stated_shape_limits_are_the_code_s():
    """The README's list of model-shape limits names every field of ``SHAPE_LIMITS`` with its value."""
    import re

    from paratrain.spec.model import SHAPE_LIMITS

    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    start = text.index("a model's `layers`")
    sentence = text[start:text.index("(`spec.model.SHAPE_LIMITS`)", start)]
    stated: dict[str, int] = {}
    # "`a`, `b` and `c` ≤ 2^16": every field named before a bound takes it
    for names, bound in re.findall(r"((?:`\w+`(?:, | and )?)+) ≤ (2\^\d+|[\d,]+)", sentence):
        value = 2 ** int(bound[2:]) if bound.startswith("2^") else int(bound.replace(",", ""))
        for name in re.findall(r"`(\w+)`", names):
            stated[name] = value
    assert stated == SHAPE_LIMITS
