"""``PARATRAIN_FAILURE_LOG``: the suite appends each failure to a file as it happens, so a run cut
off by a time limit (a lent GPU machine's) still says what failed and why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_each_failure_is_logged_with_its_reason(tmp_path: Path) -> None:
    case = tmp_path / "test_case.py"
    case.write_text("def test_fails():\n    assert 1 == 2\n\n\ndef test_passes():\n    pass\n")
    log = tmp_path / "failures.txt"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["PARATRAIN_FAILURE_LOG"] = str(log)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "-o", "addopts=", "-q", str(case)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:]
    text = log.read_text()
    assert text.startswith("== ") and "test_case.py::test_fails (call," in text and "assert 1 == 2" in text
    assert "test_passes" not in text
