"""Workers forked from a preloaded server: their CPU time reaches the launcher's accounting, and
each launch gives them the launcher's environment as it is then."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from paratrain.runtime.forkserver import forked_workers, worker_started
from paratrain.runtime.launch import _sync_environ


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@pytest.mark.dist
def test_the_workers_cpu_time_is_counted_as_the_launchers_childrens() -> None:
    before = os.times()
    with forked_workers([]) as ctx:
        procs = [ctx.Process(target=_burn, args=(0.4,)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0]
    after = os.times()
    children = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    # 0.8 s of the workers' CPU plus the server's own; a server left running would add nothing
    assert children >= 0.75, children


def test_a_launch_gives_workers_the_launchers_environment_and_keeps_the_agents(monkeypatch) -> None:
    # the worker as forked: the server's environment from its start, then the agent's variables
    monkeypatch.setenv("PARATRAIN_FAULT", "kill:1:3")      # stale: the launcher has dropped it since
    monkeypatch.setenv("PARATRAIN_TEST_SAME", "1")
    monkeypatch.setenv("RANK", "1")                         # the agent's
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")        # the agent's
    monkeypatch.delenv("PARATRAIN_TEST_NEW", raising=False)
    launcher = {k: v for k, v in os.environ.items() if k not in ("PARATRAIN_FAULT", "RANK", "TORCHELASTIC_RUN_ID")}
    launcher["PARATRAIN_TEST_NEW"] = "set after the server started"
    launcher["RANK"] = "0"                                  # the launcher's own, not the worker's
    _sync_environ(launcher)
    assert "PARATRAIN_FAULT" not in os.environ
    assert os.environ["PARATRAIN_TEST_NEW"] == "set after the server started"
    assert os.environ["PARATRAIN_TEST_SAME"] == "1"
    assert os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RUN_ID"] == "abc"


def _start_method(queue) -> None:
    inherited = multiprocessing.get_start_method()
    worker_started()
    queue.put((inherited, multiprocessing.get_start_method()))


@pytest.mark.dist
def test_a_forked_worker_starts_its_own_subprocesses_like_a_fresh_process() -> None:
    default = multiprocessing.get_context().get_start_method()  # this process's, never set by the suite
    with forked_workers([]) as ctx:
        queue = ctx.Queue()
        p = ctx.Process(target=_start_method, args=(queue,))
        p.start()
        inherited, fresh = queue.get(timeout=60)
        p.join(60)
    assert inherited == "forkserver"  # what it would use without the reset
    assert fresh == default


def _linger(ready) -> None:
    worker_started()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # deaf to a shutdown, like a worker the launcher never knew
    ready.set()
    time.sleep(600)


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "State:\tZ" in status.read_text()  # dead, waiting for its new parent to reap it
    except FileNotFoundError:
        return True


@pytest.mark.dist
def test_a_worker_left_behind_dies_with_the_server_after_the_grace() -> None:
    start = time.monotonic()
    with forked_workers([], grace_s=0.5) as ctx:
        ready = ctx.Event()
        p = ctx.Process(target=_linger, args=(ready,), daemon=True)
        p.start()
        assert ready.wait(60)
    assert time.monotonic() - start < 30  # not the worker's 600 s
    deadline = time.monotonic() + 10
    while not _gone(p.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(p.pid)


@pytest.mark.dist
def test_forkrun_gives_torchruns_environment_and_the_first_failures_code(tmp_path: Path) -> None:
    """The tests' launcher (tests/runtime/forkrun.py): each rank sees RANK / WORLD_SIZE / MASTER_*
    as under torchrun, and a rank's failure is the launch's exit code, the others stopped."""
    import subprocess

    from tests.runtime import forkrun

    script = tmp_path / "rank.py"
    script.write_text(
        "import json, os, pathlib, sys, time\n"
        "env = {k: os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')}\n"
        "pathlib.Path(sys.argv[1], 'rank' + env['RANK']).write_text(json.dumps(env))\n"
        "if sys.argv[2] == 'fail' and env['RANK'] == '1':\n"
        "    sys.exit(3)\n"
        "time.sleep(0 if sys.argv[2] == 'ok' else 60)\n")
    ok = subprocess.run(forkrun.command(2, script, tmp_path, "ok"), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    envs = [json.loads((tmp_path / f"rank{r}").read_text()) for r in range(2)]
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    start = time.monotonic()
    failed = subprocess.run(forkrun.command(2, script, tmp_path, "fail"), capture_output=True, text=True, timeout=120)
    assert failed.returncode == 3 and "rank 1 exited with code 3" in failed.stderr
    assert time.monotonic() - start < 30  # rank 0 stopped, not waited for
