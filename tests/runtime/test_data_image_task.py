"""``--task image``: the CNN on a generated image folder, data-parallel, trains exactly like one
process on the same global batch (float64, 4 steps), and its sampling keeps the GPT path's invariant.

Two torchrun launches of tests/runtime/layout_harness.py (1 and 2 processes) run the step loop of
``paratrain train`` in float64; the dp=2 run loads with 1 worker process per rank, the reference
in the training process, which must not change a number. Tolerance ``rtol=1e-5`` as the GPT
layouts' (tests/runtime/test_runtime_equivalence.py), never loosened.
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

from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.config import TrainConfig, check_task
from paratrain.runtime.data.image_task import StepBatches
from paratrain.runtime.data.images import generate_images

HARNESS = Path(__file__).with_name("layout_harness.py")
RTOL = 1e-5
STEPS, GLOBAL_BATCH, MICROBATCH, SEED = 4, 8, 2, 5


def test_dp_ranks_split_each_steps_global_batch_and_epochs_are_permutations():
    items, g, dp = 40, 8, 2
    for step in range(10):
        whole = StepBatches(items, seed=1, steps=10, global_batch=g, dp_rank=0, dp=1).step_keys(step)
        parts = [StepBatches(items, seed=1, steps=10, global_batch=g, dp_rank=r, dp=dp).step_keys(step)
                 for r in range(dp)]
        assert parts[0] + parts[1] == whole
    one = StepBatches(items, seed=1, steps=10, global_batch=g, dp_rank=0, dp=1)
    for epoch in range(2):  # 5 steps of 8 make an epoch of 40: every item once
        keys = [k for s in range(5 * epoch, 5 * epoch + 5) for k in one.step_keys(s)]
        assert {e for e, _ in keys} == {epoch}
        assert sorted(i for _, i in keys) == list(range(items))


def test_image_task_takes_data_parallelism_and_an_image_directory_only(tmp_path):
    with pytest.raises(ConfigError) as e:
        check_task(ParallelConfig(tp=2), TrainConfig(task="image", data=str(tmp_path)))
    assert e.value.field == "--task"
    with pytest.raises(ConfigError) as e:
        check_task(ParallelConfig(), TrainConfig(task="image"))
    assert e.value.field == "--data"
    with pytest.raises(ConfigError) as e:
        TrainConfig(loader_workers=-1)
    assert e.value.field == "--loader-workers"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _launch(out: Path, data: Path, nproc: int, workers: int) -> dict[str, Any]:
    name = f"image-dp{nproc}"
    train = {"steps": STEPS, "seed": SEED, "lr": 3e-3, "timeout_s": 120, "task": "image", "data": str(data),
             "loader_workers": workers}
    runs = [{"name": name, "model": "gpt-tiny", "fp64": True, "train": train,
             "parallel": {"dp": nproc, "global_batch": GLOBAL_BATCH, "microbatch": MICROBATCH}}]
    spec = out / f"{name}.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    cmd = forkrun.command(nproc, str(HARNESS), str(spec))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, f"launch of {nproc} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rows = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
    return {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
            "params": torch.load(out / f"{name}.pt")}


@pytest.mark.slow
@pytest.mark.dist
def test_image_task_dp2_equals_one_process_in_float64(tmp_path):
    data = tmp_path / "images"
    generate_images(data, 48, 40, classes=4, seed=2)
    one = _launch(tmp_path, data, 1, workers=0)
    two = _launch(tmp_path, data, 2, workers=1)
    assert len(one["losses"]) == STEPS
    torch.testing.assert_close(two["losses"], one["losses"], rtol=RTOL, atol=0)
    torch.testing.assert_close(two["grad_norms"], one["grad_norms"], rtol=RTOL, atol=0)
    assert one["params"].keys() == two["params"].keys()
    for name, ref in one["params"].items():
        assert ref.dtype == torch.float64
        err = float((two["params"][name] - ref).norm() / ref.norm())
        assert err <= RTOL, f"{name}: relative error {err:.2e}"
    # it learned something: the parameters moved from their initialization
    assert one["losses"][0] != one["losses"][-1]
