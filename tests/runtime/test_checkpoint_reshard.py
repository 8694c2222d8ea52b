"""A checkpoint saved under one layout resumes under another: dp=2 -> tp=2, pp=2 and FSDP2.

One launch of 2 processes (tests/runtime/checkpoint_harness.py), gpt-tiny in float64: an
uninterrupted dp=2 run of 8 steps is the reference; a second dp=2 run checkpoints every 4 steps;
its step-4 checkpoint (the newer ones dropped, as if the job died after it) is resumed under
tp=2, under pp=2 (1F1B) and under FSDP2 (parameters and AdamW state sharded over dp), each
checkpointing again at step 6 (a snapshot overlapping a step of that layout). The step-6
checkpoints of tp=2 and FSDP2, whose state is DTensors that the writer process saves as pieces at
their offsets, are resumed under dp=2 in turn. Every resumed step's loss must equal the reference's
within the float64 layout tolerance of the layout equivalence tests (rtol 1e-9: the layouts
round differently only in the last bits), and so must the final parameters. The checkpoint
itself is exact: the uninterrupted run with checkpointing must reproduce the reference bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.runtime import forkrun

pytestmark = [pytest.mark.slow, pytest.mark.dist]

HARNESS = Path(__file__).with_name("checkpoint_harness.py")
RTOL = 1e-9
STEPS, SAVED = 8, 4
BASE = {"global_batch": 8, "microbatch": 1}
TRAIN = {"steps": STEPS, "seed": 0, "lr": 3e-3, "data": "synthetic", "timeout_s": 120.0}


def _rows(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    out = tmp_path_factory.mktemp("reshard")
    saved = out / "saved"
    drop = [f"step_{s:08d}" for s in range(SAVED + 1, STEPS + 1)]

    def resumed(name: str, parallel: dict[str, Any], **train: Any) -> dict[str, Any]:
        return {"name": name, "parallel": {**BASE, **parallel},
                # checkpoints at step 6 too: a snapshot overlapping a step under each layout
                "train": {**TRAIN, **train, "checkpoint_dir": str(out / name), "resume": True, "keep": 0,
                          "checkpoint_every": "2"},
                "copy_from": str(saved), "drop_steps": drop}

    plan = [
        {"name": "ref", "parallel": {**BASE, "dp": 2}, "train": TRAIN},
        {"name": "saved", "parallel": {**BASE, "dp": 2},
         "train": {**TRAIN, "checkpoint_dir": str(saved), "checkpoint_every": str(SAVED), "keep": 0}},
        resumed("tp2", {"tp": 2}),
        resumed("pp2", {"pp": 2, "schedule": "1f1b"}),
        resumed("fsdp", {"dp": 2, "optimizer_sharding": True}, dp_impl="fsdp"),
        # back from DTensor pieces: their step-6 checkpoints (the final step 8 dropped) under dp=2
        {**resumed("from_tp2", {"dp": 2}), "copy_from": str(out / "tp2"), "drop_steps": [f"step_{STEPS:08d}"]},
        {**resumed("from_fsdp", {"dp": 2}), "copy_from": str(out / "fsdp"), "drop_steps": [f"step_{STEPS:08d}"]},
    ]
    spec = out / "runs.json"
    spec.write_text(json.dumps({"out": str(out), "runs": plan}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = forkrun.command(2, str(HARNESS), str(spec))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return out, {r["name"]: _rows(out, r["name"]) for r in plan}


def test_checkpointing_does_not_change_training(runs) -> None:
    _, rows = runs
    assert [r["loss"] for r in rows["saved"]] == [r["loss"] for r in rows["ref"]]
    assert [r.get("checkpoint_step") for r in rows["saved"]][SAVED - 1] == SAVED


@pytest.mark.parametrize("layout", ["tp2", "pp2", "fsdp"])
def test_resumed_under_another_layout_continues_the_same_training(runs, layout: str) -> None:
    out, rows = runs
    got = rows[layout]
    assert [r["step"] for r in got] == list(range(SAVED, STEPS))  # resumed at the checkpoint's step
    want = [r["loss"] for r in rows["ref"][SAVED:]]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]), torch.tensor(want), rtol=RTOL, atol=0)
    final, ref = torch.load(out / f"{layout}.pt", weights_only=True), torch.load(out / "ref.pt", weights_only=True)
    assert final.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(final[name], ref[name], rtol=RTOL, atol=1e-12)
    assert [r.get("checkpoint_step") for r in got] == [None, 6, None, None]


@pytest.mark.parametrize("layout", ["tp2", "fsdp"])
def test_dtensor_pieces_written_by_the_writer_process_load_under_another_layout(runs, layout: str) -> None:
    out, rows = runs
    got = rows[f"from_{layout}"]
    assert [r["step"] for r in got] == [6, 7]
    want = [r["loss"] for r in rows["ref"][6:]]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got]), torch.tensor(want), rtol=RTOL, atol=0)
    final, ref = torch.load(out / f"from_{layout}.pt", weights_only=True), torch.load(out / "ref.pt", weights_only=True)
    for name in ref:
        torch.testing.assert_close(final[name], ref[name], rtol=RTOL, atol=1e-12)
