"""A checkpoint is all or nothing: a kill in any phase of its write leaves the previous one
loadable, and a damaged file is detected and reported, never loaded.

One process (``paratrain train``, gpt-tiny, checkpoints every 3 of 8 steps) killed with SIGKILL
during the checkpoint of step 6 in each phase in turn (``PARATRAIN_FAULT=kill-checkpoint:0:6:PHASE``):
*snapshot* (half the host copies made, nothing on disk), *persist* (DCP's files written, no marker),
*marker* (the marker written to its temporary name, not renamed). After each, step 3 is the newest
complete checkpoint and verifies; a last ``--resume`` run loads it and finishes. Then one bit is
flipped in the newest checkpoint and another is truncated: both are reported by ``checkpoint
inspect`` and skipped by ``--resume``, which fails with one line when nothing sound is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import assert_one_line_error

from paratrain.runtime.checkpoint import store
from paratrain.runtime.faults import CHECKPOINT_PHASES

pytestmark = pytest.mark.slow

FLAGS = ["--model", "gpt-tiny", "--steps", "8", "--checkpoint-every", "3", "--data", "synthetic", "--no-progress"]


def _train(ckpt: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env.pop("PARATRAIN_FAULT", None)
    if fault:
        env["PARATRAIN_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "paratrain", "train", *FLAGS, "--checkpoint-dir", str(ckpt), *extra],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """The checkpoints after each kill, each step directory's file names with them (the later runs
    rewrite step 6)."""
    ckpt = tmp_path_factory.mktemp("atomic") / "ckpt"
    after: dict[str, list[store.CheckpointInfo]] = {}
    names: dict[str, list[str]] = {}
    for i, phase in enumerate(CHECKPOINT_PHASES):
        proc = _train(ckpt, *(["--resume"] if i else []), fault=f"kill-checkpoint:0:6:{phase}")
        assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILL
        assert f"during the {phase} of checkpoint step 6" in proc.stderr
        after[phase] = store.list_checkpoints(ckpt)
        names[phase] = sorted(p.name for p in (ckpt / "step_00000006").glob("*"))
    final = _train(ckpt, "--resume", "--metrics", str(ckpt.parent / "final.jsonl"))
    assert final.returncode == 0, final.stderr[-2000:]
    return ckpt, {"checkpoints": after, "names": names}, final.stdout


@pytest.mark.parametrize("phase", CHECKPOINT_PHASES)
def test_a_kill_in_any_phase_leaves_the_previous_checkpoint(killed, phase: str) -> None:
    _, after, _ = killed
    found = {c.step: c for c in after["checkpoints"][phase]}
    assert found[3].status == "complete" and found[3].problem is None
    if phase == "snapshot":
        assert 6 not in found  # nothing reached the disk
    else:
        assert found[6].status == "incomplete"
        assert found[6].files  # DCP's files are there, without a marker they do not count
    if phase == "marker":
        assert any(n.startswith(f".{store.MARKER}.") and n.endswith(".tmp") for n in after["names"][phase])


def test_resume_after_the_kills_loads_the_previous_checkpoint(killed) -> None:
    ckpt, _, stdout = killed
    assert f"resumed from {ckpt / 'step_00000003'} (step 3" in stdout
    rows = [json.loads(line) for line in (ckpt.parent / "final.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(3, 8))
    # the rewritten step 6 and the final step 8 complete; --keep 2 pruned step 3
    assert [(c.step, c.status) for c in store.list_checkpoints(ckpt)] == [(6, "complete"), (8, "complete")]


def test_damaged_files_are_reported_and_never_loaded(killed, run_cli) -> None:
    ckpt, _, _ = killed
    newest = ckpt / "step_00000008" / "__0_0.distcp"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    newest.write_bytes(bytes(data))
    older = ckpt / "step_00000006" / ".metadata"
    older.write_bytes(older.read_bytes()[:-10])  # truncated

    code, out, _ = run_cli("checkpoint", "inspect", str(ckpt), "--json")
    assert code == 0
    doc = json.loads(out)
    problems = {c["step"]: (c["status"], c["problem"]) for c in doc["checkpoints"]}
    assert problems[8][0] == "corrupt" and "CRC-32 check" in problems[8][1]
    assert problems[6][0] == "corrupt" and "truncated" in problems[6][1]
    assert doc["newest_complete_step"] is None

    with pytest.raises(Exception, match="no complete checkpoint"):
        store.resume_checkpoint(ckpt)
    before = sorted(p.name for p in ckpt.rglob("*"))
    code, _, err = run_cli("train", *FLAGS, "--checkpoint-dir", str(ckpt), "--resume")
    assert_one_line_error(code, err, "--resume", "no complete checkpoint", "corrupt")
    assert sorted(p.name for p in ckpt.rglob("*")) == before  # nothing deleted
