"""Shared test helpers."""

from __future__ import annotations

import os

import pytest

# The suite's training runs are CPU runs (their numerical checks are meant for every x86-64 CPU),
# also on a machine with a GPU; tests/runtime/test_gpu_runtime.py asks for CUDA itself. Set here,
# not in a fixture, so every subprocess a test launches inherits it.
os.environ["PARATRAIN_DEVICE"] = "cpu"

# The longest files, longest first (pytest --durations, 2026-11-24): xdist hands files out in
# collection order, so these start first and the short ones fill the end.
LONGEST_FILES = (
    "tests/runtime/test_checkpoint_async.py", "tests/runtime/test_checkpoint_exact.py", "tests/test_readme.py",
    "tests/runtime/test_runtime_equivalence.py", "tests/runtime/test_compress.py",
    "tests/runtime/test_runtime_faults.py", "tests/runtime/test_checkpoint_reshard.py",
    "tests/runtime/test_sharding_equivalence.py", "tests/runtime/test_train_signals.py",
    "tests/runtime/test_checkpoint_atomicity.py", "tests/runtime/test_pipeline_equivalence.py",
    "tests/cost/test_cost_calibrate.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, then the other files with a slow test, each file's tests in their
    order: the suite runs on two xdist workers file by file (pyproject's addopts), and a long file
    picked up last would leave one worker alone at the end."""
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def key(item: pytest.Item) -> tuple[int, bool]:
        path = item.nodeid.split("::")[0]
        rank = LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)
        return rank, path not in slow_files

    items.sort(key=key)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``PARATRAIN_FAILURE_LOG=FILE``, each failure is appended to FILE as it happens (by the
    xdist controller), so a run stopped by a time limit before its summary still says what failed
    and why (bench/gpu_checks.sh uses it on a lent GPU machine)."""
    path = os.environ.get("PARATRAIN_FAILURE_LOG")
    if path and report.failed and os.environ.get("PYTEST_XDIST_WORKER") is None:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"== {report.nodeid} ({report.when}, {report.duration:.0f} s)\n{str(report.longrepr)[-2000:]}\n")


@pytest.fixture(autouse=True)
def _own_calibration_cache(tmp_path_factory, monkeypatch):
    """Tests never read (or write) the user's `paratrain calibrate` results: the `cpu` device is
    the built-in estimate unless a test calibrates into its own directory."""
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "paratrain-cache"))


@pytest.fixture
def run_cli(capsys):
    """Run the paratrain CLI in-process; returns (exit_code, stdout, stderr)."""
    from paratrain.cli import main

    def _run(*args: str) -> tuple[int, str, str]:
        code = 0
        try:
            main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out = capsys.readouterr()
        return code, out.out, out.err

    return _run


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    """A bad-input failure: exit 2, one line on stderr naming the field, no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, f"exit code {code}, stderr: {err!r}"
    assert len(lines) == 1, f"expected one error line, got {lines!r}"
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
