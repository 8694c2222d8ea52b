"""A job killed mid-run and resumed trains exactly as if it had never stopped (2 processes).

``paratrain train --nproc 2 --dp 2`` for 24 steps uninterrupted; again with checkpoints every 4
steps and ``PARATRAIN_FAULT=kill:1:14`` (rank 1 dies inside step 14, after the checkpoints of
steps 4-12); then ``--resume`` to step 24. From the resumed step on, every loss and gradient norm
equals the uninterrupted run's bit for bit (same machine, same kernels), and so do the final
parameters: the checkpoint holds the whole training state (weights, AdamW moments and step,
generators; the step fixes learning rate and batches).
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

STEPS, KILL_AT, EVERY = 24, 14, 4
FLAGS = ["--model", "gpt-tiny", "--dp", "2", "--nproc", "2", "--steps", str(STEPS), "--data", "synthetic",
         "--no-progress", "--log-every", "10", "--timeout", "60"]


def _train(*extra: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    if fault:
        env["PARATRAIN_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "paratrain", "train", *FLAGS, *extra], capture_output=True,
                          text=True, timeout=300, env=env)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_killed_and_resumed_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    ref = _train("--metrics", str(tmp_path / "ref.jsonl"), "--save-final", str(tmp_path / "ref.pt"))
    assert ref.returncode == 0, ref.stderr[-3000:]

    ckpt = tmp_path / "ckpt"
    killed = _train("--metrics", str(tmp_path / "killed.jsonl"), "--checkpoint-dir", str(ckpt),
                    "--checkpoint-every", str(EVERY), fault=f"kill:1:{KILL_AT}")
    assert killed.returncode != 0
    assert f"killing this rank at step {KILL_AT}" in killed.stderr

    resumed = _train("--metrics", str(tmp_path / "resumed.jsonl"), "--checkpoint-dir", str(ckpt),
                     "--checkpoint-every", str(EVERY), "--resume", "--save-final", str(tmp_path / "resumed.pt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = _rows(tmp_path / "resumed.jsonl")[0]["step"]
    # the newest complete checkpoint before the kill: step 12, or 8 had 12's write not finished
    assert start in (8, 12), resumed.stdout
    assert f"resumed from {ckpt / f'step_{start:08d}'} (step {start}" in resumed.stdout

    want = _rows(tmp_path / "ref.jsonl")[start:]
    got = _rows(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in got] == list(range(start, STEPS))
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in want]
    final, ref_final = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "ref.pt")
    assert all(torch.equal(final[k], ref_final[k]) for k in ref_final)
    # the final save is a checkpoint too
    assert (ckpt / f"step_{STEPS:08d}" / "paratrain-checkpoint.json").is_file()


@pytest.mark.parametrize("layout", [
    # paratrain's distributed optimizer: AdamW's state in dp slices, gathered into whole parameters
    # at a checkpoint (the format every layout loads) and sliced back at a resume
    ("--sharding", "zero1"),
    # FSDP2 inside the pipeline engine: every chunk's parameters and state sharded over its stage's dp
    ("--sharding", "zero3", "--dp-impl", "fsdp", "--pp", "2", "--nproc", "4", "--schedule", "1f1b"),
    # Chimera: each chunk's AdamW state sliced over both pipelines' holders (every copy its own
    # slice) and the context-parallel ranks (parameters replicated over cp)
    ("--sharding", "zero1", "--dp", "1", "--cp", "2", "--pp", "2", "--schedule", "chimera", "--layers", "4",
     "--nproc", "4"),
], ids=["zero1-dp2", "zero3-dp2-pp2", "zero1-cp2-pp2-chimera"])
def test_sharded_checkpoint_resumes_exactly(tmp_path: Path, layout: tuple[str, ...]) -> None:
    """Resumed from step 4 of an 8-step run (its step-8 checkpoint removed), every loss, gradient
    norm and final parameter of a sharded layout equals the uninterrupted run's bit for bit."""
    steps, every = 8, 4
    sharded = [*layout, "--steps", str(steps), "--checkpoint-every", str(every)]
    ckpt = tmp_path / "ckpt"
    ref = _train(*sharded, "--checkpoint-dir", str(ckpt), "--metrics", str(tmp_path / "ref.jsonl"),
                 "--save-final", str(tmp_path / "ref.pt"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    import shutil

    shutil.rmtree(ckpt / f"step_{steps:08d}")  # the newest left is step 4's
    resumed = _train(*sharded, "--checkpoint-dir", str(ckpt), "--resume", "--metrics", str(tmp_path / "resumed.jsonl"),
                     "--save-final", str(tmp_path / "resumed.pt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt / f'step_{every:08d}'} (step {every}" in resumed.stdout
    got, want = _rows(tmp_path / "resumed.jsonl"), _rows(tmp_path / "ref.jsonl")[every:]
    assert [r["step"] for r in got] == list(range(every, steps))
    assert [(r["loss"], r["grad_norm"]) for r in got] == [(r["loss"], r["grad_norm"]) for r in want]
    final, ref_final = torch.load(tmp_path / "resumed.pt"), torch.load(tmp_path / "ref.pt")
    assert all(torch.equal(final[k], ref_final[k]) for k in ref_final)
