"""Bad input and faults end the job with one clear line per rank, never a hang.

Multi-process cases start the workers as plain processes with the torchrun environment
(RANK, WORLD_SIZE, MASTER_ADDR/PORT) and no launcher agent, so each survivor must notice the
failure by itself (an agent would stop them with SIGTERM first).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from tests.conftest import assert_one_line_error

from paratrain.runtime.launch import free_port

TINY = ["--model", "gpt-tiny", "--steps", "4", "--global-batch", "8", "--no-progress"]


def _worker_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PARATRAIN_FAULT"}
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), OMP_NUM_THREADS="1", **extra)
    return env


def _wait_all(procs: list[subprocess.Popen], limit_s: float) -> list[float]:
    """Each process's end time (monotonic seconds), polling; output is small enough for the pipes."""
    ended: list[float | None] = [None] * len(procs)
    deadline = time.monotonic() + limit_s
    while any(e is None for e in ended) and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    assert all(e is not None for e in ended), "a rank hung"
    return [float(e) for e in ended]  # type: ignore[arg-type]


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "error:" in ln]


@pytest.mark.dist
@pytest.mark.slow
def test_killed_rank_ends_every_survivor_with_one_message_before_the_timeout() -> None:
    timeout_s = 60
    port = free_port()
    world = 4
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "paratrain", "train", *TINY, "--dp", "2", "--tp", "2", "--timeout", str(timeout_s)],
            env=_worker_env(r, world, port, PARATRAIN_FAULT="kill:1:2"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(world)
    ]
    ended = _wait_all(procs, limit_s=240)
    outputs = [p.communicate() for p in procs]
    assert procs[1].returncode == -9, outputs[1]
    for r in (0, 2, 3):
        err = outputs[r][1]
        lines = _error_lines(err)
        assert procs[r].returncode == 1, (r, procs[r].returncode, err[-2000:])
        assert len(lines) == 1, (r, lines)
        assert lines[0].startswith(f"[rank {r}] error: job aborted during step 2"), lines[0]
        assert "peer rank" in lines[0]
        assert "Traceback" not in err
    # Survivors learn of the death from closed connections, long before the 60 s timeout.
    for r in (0, 2, 3):
        assert ended[r] - ended[1] < timeout_s / 2, (r, ended[r] - ended[1])
    steps_done = [ln for ln in outputs[0][0].splitlines() if ln.startswith("[rank 0] step ")]
    assert len(steps_done) == 2  # steps 0 and 1 completed, step 2 was cut


@pytest.mark.dist
def test_unreachable_rendezvous_fails_within_the_timeout() -> None:
    port = free_port()  # nothing listens there
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", *TINY, "--dp", "2", "--timeout", "3"],
                          env=_worker_env(1, 2, port), capture_output=True, text=True, timeout=120)
    lines = _error_lines(proc.stderr)
    assert proc.returncode == 1
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"[rank 1] error: cannot reach the rendezvous at 127.0.0.1:{port} within 3 s")
    assert time.monotonic() - start < 60


@pytest.mark.dist
def test_world_size_mismatch_under_a_launcher_is_reported_before_any_collective() -> None:
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", *TINY, "--dp", "2", "--tp", "2"],
                          env=_worker_env(0, 2, free_port()), capture_output=True, text=True, timeout=120)
    assert_one_line_error(proc.returncode, proc.stderr, "[rank 0] error: world size",
                          "dp(2)*tp(2)*pp(1)=4 != world_size(2)")


def test_world_size_mismatch_with_nproc(run_cli) -> None:
    code, _, err = run_cli("train", *TINY, "--dp", "2", "--tp", "2", "--nproc", "2")
    assert_one_line_error(code, err, "dp(2)*tp(2)*pp(1)=4 != world_size(2)")


def test_multi_rank_layout_without_launcher(run_cli, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, _, err = run_cli("train", *TINY, "--dp", "2")
    assert_one_line_error(code, err, "dp(2)*tp(1)*pp(1)=2 != world_size(1)", "--nproc 2")


def test_tp_not_dividing_heads(run_cli) -> None:
    code, _, err = run_cli("train", *TINY, "--tp", "3", "--global-batch", "3", "--nproc", "3")
    assert_one_line_error(code, err, "tp(3) does not divide the 4 attention heads")


def test_tp_not_dividing_vocabulary(run_cli) -> None:
    code, _, err = run_cli("train", *TINY, "--vocab", "255", "--tp", "2", "--nproc", "2")
    assert_one_line_error(code, err, "tp(2) does not divide the vocabulary 255")


def test_missing_data_path(run_cli, tmp_path) -> None:
    code, _, err = run_cli("train", *TINY, "--data", str(tmp_path / "nothing"))
    assert_one_line_error(code, err, "--data", "does not exist")


def test_unknown_dp_impl(run_cli) -> None:
    code, _, err = run_cli("train", *TINY, "--dp-impl", "horovod")
    assert_one_line_error(code, err, "--dp-impl", "unknown value 'horovod'")




def test_a_rendezvous_port_lies_below_the_ephemeral_range_and_is_free() -> None:
    """Outgoing connections (gloo's, one per pair of ranks) take ports from the kernel's ephemeral
    range; a rendezvous port chosen there could be taken before the store binds it."""
    import socket

    from paratrain.runtime.launch import _ephemeral_low

    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", ports.pop()))  # still free
