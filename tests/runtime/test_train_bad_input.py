"""Bad input to ``paratrain train`` is rejected before anything starts: exit 2, one line on
stderr naming the flag, no traceback, within seconds (a launch of workers alone takes longer).

Run in-process (``run_cli``): a case that reached the launcher would start worker processes and
blow the time bound; with ``--nproc 2`` every case also covers the launcher's path."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tests.conftest import assert_one_line_error

TINY = ["--model", "gpt-tiny", "--steps", "2", "--global-batch", "4", "--no-progress", "--data", "synthetic"]
FAST_S = 5.0

# (flags, text the error line must contain)
CASES: dict[str, tuple[list[str], list[str]]] = {
    "lr-inf": (["--lr", "inf"], ["--lr", "inf"]),
    "lr-nan": (["--lr", "nan"], ["--lr", "nan"]),
    "grad-clip-nan": (["--grad-clip", "nan"], ["--grad-clip"]),
    "grad-clip-negative": (["--grad-clip", "-1"], ["--grad-clip", "-1"]),
    "warmup-negative": (["--warmup", "-1"], ["--warmup"]),
    "log-every-zero": (["--log-every", "0"], ["--log-every"]),
    "nproc-zero": (["--nproc", "0"], ["--nproc", "0"]),
    "nproc-negative": (["--nproc", "-1"], ["--nproc", "-1"]),
    "bucket-inf": (["--bucket-mb", "inf"], ["--bucket-mb"]),
    "bucket-nan": (["--bucket-mb", "nan"], ["--bucket-mb"]),
    "timeout-inf": (["--timeout", "inf"], ["--timeout"]),
    "timeout-nan": (["--timeout", "nan"], ["--timeout"]),
    "timeout-negative": (["--timeout", "-1"], ["--timeout"]),
    "steps-zero": (["--steps", "0"], ["--steps"]),
    # within the model spec's own limits, beyond any machine's memory: 3.3e12 parameters (~53 TB
    # with AdamW), 2.6e11 in the embedding alone; the line states the machine's limit
    "hidden-absurd": (["--hidden", "65536", "--layers", "64"], ["--hidden", "GB of memory available"]),
    "vocab-absurd": (["--vocab", "4000000", "--hidden", "65536"], ["--vocab", "GB of memory available"]),
}


@pytest.mark.parametrize("launcher", [False, True], ids=["one-process", "nproc-2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_flag_fails_up_front(run_cli, case: str, launcher: bool) -> None:
    flags, needles = CASES[case]
    extra = ["--dp", "2", "--nproc", "2"] if launcher and "--nproc" not in flags else []
    start = time.monotonic()
    code, _, err = run_cli("train", *TINY, *extra, *flags)
    assert time.monotonic() - start < FAST_S, err
    assert_one_line_error(code, err, *needles)


@pytest.mark.parametrize("launcher", [False, True], ids=["one-process", "nproc-2"])
@pytest.mark.parametrize(("device", "needle"), [("cuda", "GPU(s) visible"), ("tpu", "unknown device 'tpu'")])
def test_a_device_the_machine_lacks_fails_up_front(run_cli, monkeypatch, launcher: bool, device: str,
                                                    needle: str) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on the CI machine, also on a GPU one
    monkeypatch.setenv("PARATRAIN_DEVICE", device)
    extra = ["--dp", "2", "--nproc", "2"] if launcher else []
    assert_one_line_error(*run_cli("train", *TINY, *extra)[::2], "PARATRAIN_DEVICE", needle)


def _paths(tmp_path: Path) -> dict[str, tuple[str, str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return {
        "directory": (str(tmp_path), "is a directory"),
        "parent-is-a-file": (str(a_file / "out.json"), "is not a directory"),
        "ancestor-is-a-file": (str(a_file / "sub" / "out.json"), "is not a directory"),
    }


@pytest.mark.parametrize("launcher", [False, True], ids=["one-process", "nproc-2"])
@pytest.mark.parametrize("flag", ["--metrics", "--trace", "--save-final"])
@pytest.mark.parametrize("kind", ["directory", "parent-is-a-file", "ancestor-is-a-file"])
def test_unwritable_output_fails_before_training(run_cli, tmp_path: Path, flag: str, kind: str,
                                                 launcher: bool) -> None:
    path, needle = _paths(tmp_path)[kind]
    extra = ["--dp", "2", "--nproc", "2"] if launcher else []
    start = time.monotonic()
    code, out, err = run_cli("train", *TINY, *extra, flag, path)
    assert time.monotonic() - start < FAST_S, err
    assert_one_line_error(code, err, flag, needle)
    assert "step" not in out  # nothing trained


def test_metrics_path_with_rank_placeholder_is_checked(run_cli, tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    code, _, err = run_cli("train", *TINY, "--metrics", str(a_file / "m{rank}.jsonl"))
    assert_one_line_error(code, err, "--metrics", "is not a directory")


# What context parallelism does not run with yet is refused by name before any worker starts.
CP_CASES: dict[str, tuple[list[str], list[str]]] = {
    "cp-seq-indivisible": (["--cp", "3", "--nproc", "3"], ["cp", "2*cp = 6"]),
    # gTop-k's recursive doubling over the dp x cp reduction group
    "cp-gtopk-group": (["--seq", "60", "--cp", "3", "--compress", "gtopk", "--nproc", "3"], ["gtopk", "cp(3)"]),
}


@pytest.mark.parametrize("case", sorted(CP_CASES))
def test_context_parallel_limits_fail_up_front(run_cli, case: str) -> None:
    flags, needles = CP_CASES[case]
    start = time.monotonic()
    code, out, err = run_cli("train", *TINY, *flags)
    assert time.monotonic() - start < FAST_S, err
    assert_one_line_error(code, err, *needles)
    assert "step" not in out

