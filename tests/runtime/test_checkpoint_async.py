"""Checkpointing an asynchronous pipeline (PipeDream-2BW, pp=2, 2 processes): drain, kill, resume.

An asynchronous schedule runs its steps as one action list with several weight versions alive.
With ``--checkpoint-dir`` the run drains at each checkpoint step: the steps up to it run as one
action list generated over just those steps, so every micro-batch in flight finishes, its
gradient is applied and no stashed version is left; the checkpoint holds that one state (weights,
AdamW state, generators; the step fixes learning rate and batches), and the next segment starts
from it. So:

* a 2BW (and a PipeDream) run checkpointing (draining) every 4 steps, killed inside step 10 and
  resumed, equals the same run uninterrupted, with the same drains, bit for bit (losses, gradient
  norms, final parameters);
* a 2BW run draining after every step is synchronous training: each batch computes on the
  current weights (version 0 of its one-step segment) and the update applies its accumulated
  gradient, which is 1F1B's gradient accumulation. With clipping off (2BW clips each stage by its
  own norm, 1F1B by the global one) the losses agree with 1F1B's to float32 rounding. Undrained
  2BW, which computes batch t on the weights before the last update, differs from synchronous
  training (tests/runtime/test_pipeline_equivalence.py, ``test_weight_versions_change_the_result``).
* the tied embedding and output projection, which the two stages clip by their own norms, are one
  state again at every drain (the first stage's), so the checkpoint, saved by full-model name, is
  the whole state (without that the resumed run differs in the 7th digit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.dist]

STEPS, EVERY, KILL_AT = 16, 4, 10
FLAGS = ["--model", "gpt-tiny", "--pp", "2", "--nproc", "2", "--data", "synthetic", "--no-progress",
         "--log-every", "100", "--timeout", "60", "--global-batch", "4", "--microbatch", "1"]


def _train(*extra: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    if fault:
        env["PARATRAIN_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "paratrain", "train", *FLAGS, *extra], capture_output=True,
                          text=True, timeout=300, env=env)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("schedule", ["2bw", "pipedream"])
def test_killed_and_resumed_async_run_equals_the_uninterrupted_one_with_the_same_drains(tmp_path: Path,
                                                                                         schedule: str) -> None:
    common = ["--schedule", schedule, "--steps", str(STEPS), "--checkpoint-every", str(EVERY)]
    ref = _train(*common, "--checkpoint-dir", str(tmp_path / "ref"), "--metrics", str(tmp_path / "ref.jsonl"),
                 "--save-final", str(tmp_path / "ref.pt"))
    assert ref.returncode == 0, ref.stderr[-3000:]

    ckpt = tmp_path / "ckpt"
    killed = _train(*common, "--checkpoint-dir", str(ckpt), fault=f"kill:1:{KILL_AT}")
    assert killed.returncode != 0
    assert f"killing this rank at step {KILL_AT}" in killed.stderr

    resumed = _train(*common, "--checkpoint-dir", str(ckpt), "--resume", "--metrics",
                     str(tmp_path / "resumed.jsonl"), "--save-final", str(tmp_path / "resumed.pt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = _rows(tmp_path / "resumed.jsonl")
    start = got[0]["step"]
    assert start in (4, 8), resumed.stdout  # 8, or 4 had the write of 8 not finished at the kill
    want = _rows(tmp_path / "ref.jsonl")[start:]
    assert [r["step"] for r in got] == list(range(start, STEPS))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]
    final, ref_final = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "ref.pt")
    assert final.keys() == ref_final.keys()
    assert all(torch.equal(final[k], ref_final[k]) for k in ref_final)


def test_2bw_drained_after_every_step_is_synchronous_training(tmp_path: Path) -> None:
    common = ["--steps", "6", "--grad-clip", "inf"]
    sync = _train(*common, "--schedule", "1f1b", "--metrics", str(tmp_path / "sync.jsonl"))
    assert sync.returncode == 0, sync.stderr[-3000:]
    drained = _train(*common, "--schedule", "2bw", "--checkpoint-dir", str(tmp_path / "ck"),
                     "--checkpoint-every", "1", "--metrics", str(tmp_path / "drained.jsonl"))
    assert drained.returncode == 0, drained.stderr[-3000:]
    want = [r["loss"] for r in _rows(tmp_path / "sync.jsonl")]
    got = [r["loss"] for r in _rows(tmp_path / "drained.jsonl")]
    assert got == pytest.approx(want, rel=1e-6)
    assert "checkpoint step 5 complete" in drained.stdout  # it drained (and checkpointed) after every step
