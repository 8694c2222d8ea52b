"""The README quotes what the code prints: every block under ``<!-- regen -->`` is re-run here.

``python docs/regen.py`` rewrites the blocks; this test fails when one of them is stale.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _regen():
    spec = importlib.util.spec_from_file_location("paratrain_docs_regen", ROOT / "docs" / "regen.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


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


@pytest.mark.slow
def test_readme_figures_match_the_code() -> None:
    regen = _regen()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(regen.find_blocks(text.splitlines())) >= 5, "the README's quoted outputs should be regen blocks"
    diff = regen.stale_diff()
    assert diff == "", "README figures differ from what the code prints; run `python docs/regen.py`:\n" + diff[:6000]
