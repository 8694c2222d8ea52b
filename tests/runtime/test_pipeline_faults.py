"""A pipeline run that cannot work ends with a clear message, never a hang.

* bad pipeline flags fail before any process starts: one line on stderr, exit 2;
* ranks launched with different schedules (two "nodes" of one rendezvous with different
  ``--schedule``) stop at the start-up check, every rank naming the disagreement, exit 2;
* a rank killed mid-run ends the job well within the timeout, the survivor saying what it was doing
  (or the launcher naming the dead rank, when it stops the survivor first).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from tests.conftest import assert_one_line_error

TINY = ["--model", "gpt-tiny", "--layers", "4", "--steps", "3", "--global-batch", "8", "--microbatch", "2",
        "--no-progress", "--data", "synthetic"]


@pytest.mark.parametrize(("flags", "needles"), [
    (["--pp", "3", "--layers", "6", "--schedule", "chimera", "--nproc", "3"], ["stages", "even"]),
    (["--pp", "2", "--schedule", "zigzag", "--nproc", "2"], ["schedule", "zigzag"]),
    (["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "1", "--nproc", "2"], ["virtual"]),
    (["--pp", "2", "--schedule", "2bw", "--global-batch", "2", "--nproc", "2"], ["micro-batches"]),
    (["--pp", "2", "--dp-impl", "ddp", "--nproc", "2"], ["--dp-impl"]),
])
def test_bad_pipeline_flags_fail_before_launch(run_cli, flags: list[str], needles: list[str]) -> None:
    args = [*TINY, *flags]
    if "--layers" in flags:  # the later --layers wins in the flag list; keep one
        i = args.index("--layers")
        del args[i:i + 2]
    code, _, err = run_cli("train", *args)
    assert_one_line_error(code, err, *needles)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.mark.dist
@pytest.mark.slow
def test_ranks_with_different_schedules_stop_with_a_clear_message() -> None:
    from paratrain.runtime.launch import free_port

    port = free_port()
    procs = []
    for node, schedule in enumerate(("1f1b", "gpipe")):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"mismatch-{port}", "-m", "paratrain", "train", *TINY, "--pp", "2",
               "--schedule", schedule, "--timeout", "60"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()))
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode != 0
        assert "ranks disagree on the pipeline schedule" in err, err[-2000:]
        assert "rank 0 has 1f1b" in err and "has gpipe" in err


@pytest.mark.dist
@pytest.mark.slow
def test_killed_rank_ends_the_pipeline_run() -> None:
    timeout_s = 60
    env = {**_env(), "PARATRAIN_FAULT": "kill:1:1"}
    cmd = [sys.executable, "-m", "paratrain", "train", *TINY, "--pp", "2", "--schedule", "1f1b", "--nproc", "2",
           "--timeout", str(timeout_s)]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < timeout_s + 30, f"took {elapsed:.0f} s: the survivor waited for the timeout or hung"
    err = proc.stderr
    assert "fault injection: killing this rank at step 1" in err
    # the launcher names the first failure it sees: the killed rank, or the survivor that stopped
    assert "paratrain: error: worker rank" in err, err[-3000:]
    survivor = [ln for ln in err.splitlines() if ln.startswith("[rank 0] error:")]
    launcher_saw_kill = "worker rank 1 was killed by signal 9" in err
    assert launcher_saw_kill or (survivor and "step 1" in survivor[0] and "peer rank" in survivor[0]), err[-3000:]
