"""Ctrl-C and SIGTERM end ``paratrain train --nproc 2`` with one line, the shell's exit code
(128 + signal) and no process left behind.

Each case starts the launcher in a process group of its own (as a shell starts a job), waits for
the first step line, sends the signal (SIGINT to the whole group, as Ctrl-C does; SIGTERM to the
launcher alone, as ``kill PID`` does) and then checks that every process of the group is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

CMD = [sys.executable, "-m", "paratrain", "train", "--model", "gpt-tiny", "--steps", "100000", "--nproc", "2",
       "--dp", "2", "--global-batch", "4", "--data", "synthetic", "--no-progress"]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(("sig", "to_group"), [(signal.SIGINT, True), (signal.SIGTERM, False)],
                         ids=["sigint-to-group", "sigterm-to-launcher"])
def test_signal_stops_every_worker_with_one_line(sig: signal.Signals, to_group: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    proc = subprocess.Popen(CMD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    pgid = proc.pid
    training = threading.Event()
    out: list[str] = []

    def read_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if line.startswith("[rank 0] step "):
                training.set()

    reader = threading.Thread(target=read_stdout, daemon=True)
    reader.start()
    try:
        assert training.wait(180), f"no step line within 180 s: {''.join(out)[-2000:]}"
        (os.killpg if to_group else os.kill)(pgid, sig)
        sent = time.monotonic()
        assert proc.stderr is not None
        err = proc.stderr.read()
        code = proc.wait(timeout=60)
        stopped_s = time.monotonic() - sent
    finally:
        if proc.poll() is None or _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
    assert code == 128 + sig, (code, err[-2000:])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == [f"paratrain: interrupted ({sig.name}), workers stopped"], err[-3000:]
    assert stopped_s < 30  # the workers stop at once (SIGINT's default action), no SIGKILL timeout
    # no orphan: every process of the job's group (launcher and workers) is gone
    deadline = time.monotonic() + 10
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(pgid), subprocess.run(["ps", "-o", "pid,stat,cmd", "-g", str(pgid)],
                                                  capture_output=True, text=True).stdout
