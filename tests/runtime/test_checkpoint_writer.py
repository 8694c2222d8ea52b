"""The persist phase's writer process (runtime/checkpoint/writer.py): what it writes, and how it dies.

* It reads the snapshot in place from shared memory and writes what ``torch.distributed.checkpoint.save``
  of the same tensors writes (same keys, shapes, dtypes, values), a DTensor's local piece recorded
  at its offsets in the global tensor, and the completion marker that verifies.
* A writer that dies makes the rank's next persist fail with a line naming it, not hang.
* A writer dies with its rank, and the shared-memory files are gone with them.
* ``paratrain train`` whose writer is killed fails with one line and leaves the checkpoints intact.

A DTensor saved through the writer and loaded under another layout: tests/runtime/test_checkpoint_reshard.py
(FSDP2 and tp=2 runs checkpoint, a dp=2 run resumes from them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from paratrain.runtime.checkpoint import store
from paratrain.runtime.checkpoint.writer import WriterDied, WriterProcess

pytestmark = pytest.mark.slow

MANIFEST = {"step": 3, "model": "toy"}


def _shm_files(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"paratrain-ckpt-{pid}-")] \
        if os.path.isdir("/dev/shm") else []


@pytest.fixture(scope="module")
def writer():
    w = WriterProcess(0, 1, None, timeout_s=60)
    yield w
    w.close()
    assert w.proc.returncode == 0  # stopped when asked


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model/w": torch.randn(4, 3, generator=g, dtype=torch.float64), "optim/w/step": torch.tensor(7.0),
            "model/piece": torch.randn(2, 3, generator=g), "rng/rank0/cpu": torch.get_rng_state()}


def test_the_writer_saves_what_dcp_saves_and_completes_the_marker(writer: WriterProcess, tmp_path: Path) -> None:
    want = _state()
    layout = [(k, tuple(v.shape), v.dtype) for k, v in want.items()]
    # "model/piece" is rows 2-3 of a 4x3 tensor sharded by rows (a DTensor's local piece)
    arena = writer.arena(layout, {"model/piece": ((4, 3), (2, 0))})
    for k, v in want.items():
        arena[k].copy_(v)
    assert _shm_files(os.getpid()) == []  # unlinked at once: only the open descriptors hold them
    path = store.step_dir(tmp_path / "ck", 3)
    answer = writer.persist({"path": str(path), "step": 3, "manifest": MANIFEST, "keep": 0, "rank_pid": os.getpid()})
    assert answer["persist_s"] > 0 and answer["size_bytes"] > 0 and writer.cpu_s > writer.startup_cpu_s
    [found] = store.list_checkpoints(tmp_path / "ck")
    assert found.status == "complete" and found.step == 3

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    direct = tmp_path / "direct"
    dcp.save({k: v for k, v in want.items() if k != "model/piece"}, checkpoint_id=str(direct), no_dist=True)
    other = dcp.FileSystemReader(str(direct)).read_metadata().state_dict_metadata
    for k, m in other.items():
        assert (meta[k].size, meta[k].properties.dtype, meta[k].chunks) == (m.size, m.properties.dtype, m.chunks)
    piece = meta["model/piece"]
    assert tuple(piece.size) == (4, 3)
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in piece.chunks] == [((2, 0), (2, 3))]

    got = {k: torch.zeros_like(v) for k, v in want.items() if k != "model/piece"}
    dcp.load(got, checkpoint_id=str(path), no_dist=True)
    assert all(torch.equal(got[k], want[k]) for k in got)


def test_a_dead_writer_fails_the_persist_with_its_cause() -> None:
    w = WriterProcess(0, 1, None, timeout_s=60)
    w.wait_ready()
    w.proc.kill()
    start = time.monotonic()
    with pytest.raises(WriterDied, match=r"writer process of rank 0 \(pid \d+\) was killed by SIGKILL while "
                                         r"writing checkpoint step 5"):
        w.persist({"path": "/nonexistent", "step": 5, "manifest": MANIFEST, "keep": 0, "rank_pid": os.getpid()})
    assert time.monotonic() - start < 15
    w.close()


def test_the_writer_dies_with_its_rank(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import os, signal, torch
        from paratrain.runtime.checkpoint.writer import WriterProcess
        w = WriterProcess(0, 1, None, timeout_s=60)
        w.wait_ready()
        w.arena([("x", (1000,), torch.float32)], {})
        print(w.proc.pid, os.getpid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    child, rank = (int(x) for x in proc.stdout.split())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
    assert _shm_files(rank) == []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _writer_of(pid: int) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().split(") ")[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == pid and b"paratrain.runtime.checkpoint.writer" in cmd:
            return int(entry)
    return None


def test_a_run_whose_writer_is_killed_fails_with_one_line(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK",
                                                            "PARATRAIN_FAULT")}
    run = subprocess.Popen([sys.executable, "-m", "paratrain", "train", "--model", "gpt-tiny", "--steps", "100000",
                            "--checkpoint-every", "2", "--data", "synthetic", "--no-progress", "--checkpoint-dir",
                            str(ckpt)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not list(ckpt.glob("step_*/" + store.MARKER)) and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.2)
        writer = _writer_of(run.pid)
        assert writer is not None, "no writer process found"
        os.kill(writer, signal.SIGKILL)
        _, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1, err[-2000:]
    assert "Traceback" not in err
    [line] = [x for x in err.splitlines() if "error:" in x]
    assert f"the checkpoint writer process of rank 0 (pid {writer}) was killed by SIGKILL" in line
    assert any(c.complete for c in store.list_checkpoints(ckpt))  # what was complete stays so
