"""``train --sharding zero1|zero2|zero3`` trains like one process, in float64: zero2 / zero3 are FSDP2
``fully_shard`` with ``reshard_after_forward`` False / True (whole models and every pipeline chunk),
zero1 paratrain's distributed optimizer (runtime/zero.py). One 1-process launch for the reference
and ONE 4-process launch for every layout (tests/runtime/layout_harness.py). Every layout runs several
micro-batches per replica, so each backward's reduce-scatter (the runtime keeps gradient sync on
between micro-batches) is summed into the sharded gradient; under ZB-H1 the unsharded gradients are
held over the micro-batches and reduce-scattered once, at the chunk's R."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.runtime import forkrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HARNESS = Path(__file__).with_name("layout_harness.py")
STEPS, GLOBAL_BATCH, MICROBATCH = 3, 8, 1
TRAIN = {"steps": STEPS, "seed": 5, "lr": 3e-3, "timeout_s": 120}
MODEL = {"preset": "gpt-tiny", "layers": 4}  # 4 blocks: 2 chunks on each of 2 pipeline ranks
RTOL = 1e-9  # float64: the layouts differ only in the order of sums
KEY_BIAS_NOISE = 1e-6  # the key bias has no gradient (softmax is shift invariant): Adam moves it on noise
LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "single": ({}, {}),
    "zero2-dp4": ({"dp": 4, "sharding": "zero2"}, {"dp_impl": "fsdp"}),  # 2 micro-batches per replica
    "zero3-dp2-tp2": ({"dp": 2, "tp": 2, "sharding": "fsdp"}, {"dp_impl": "fsdp"}),  # 4 micro-batches
    # FSDP2 on every pipeline chunk (each stage's dp group), reduce-scattering in each backward
    "zero2-dp2-pp2": ({"dp": 2, "pp": 2, "sharding": "zero2", "schedule": "1f1b"}, {"dp_impl": "fsdp"}),
    "zero3-dp2-pp2-interleaved": ({"dp": 2, "pp": 2, "sharding": "zero3", "schedule": "interleaved",
                                   "virtual_stages": 2}, {"dp_impl": "fsdp"}),
    # Chimera: each pipeline's copy of a chunk sharded over its dp ranks, the copies' shards summed
    "zero3-dp2-pp2-chimera": ({"dp": 2, "pp": 2, "sharding": "zero3", "schedule": "chimera"}, {"dp_impl": "fsdp"}),
    # ZB-H1's split backward: unsharded gradients held over the micro-batches, one reduce-scatter at R
    "zero3-dp2-pp2-zb": ({"dp": 2, "pp": 2, "sharding": "zero3", "schedule": "zb-h1"}, {"dp_impl": "fsdp"}),
    "zero2-dp2-pp2-zb": ({"dp": 2, "pp": 2, "sharding": "zero2", "schedule": "zb-h1"}, {"dp_impl": "fsdp"}),
    # zero1: paratrain's distributed optimizer, whole model and per pipeline chunk
    "zero1-dp4": ({"dp": 4, "sharding": "zero1"}, {}),
    "zero1-dp2-tp2": ({"dp": 2, "tp": 2, "sharding": "zero1"}, {}),
    "zero1-dp2-pp2": ({"dp": 2, "pp": 2, "sharding": "zero1", "schedule": "1f1b"}, {}),
    "zero1-dp2-pp2-interleaved": ({"dp": 2, "pp": 2, "sharding": "zero1", "schedule": "interleaved",
                                   "virtual_stages": 2}, {}),
    "zero1-dp2-pp2-zb": ({"dp": 2, "pp": 2, "sharding": "zero1", "schedule": "zb-h1"}, {}),  # split backward
    # two pipelines in opposite directions: a chunk's group holds both its copies, on two pipeline ranks
    "zero1-dp2-pp2-chimera": ({"dp": 2, "pp": 2, "sharding": "zero1", "schedule": "chimera"}, {}),
    "untied-zero1-dp2-pp2-chimera": ({"dp": 2, "pp": 2, "sharding": "zero1", "schedule": "chimera"}, {}),
    "untied-single": ({}, {}),
    # asynchronous schedules (weight versions, each stage stepping on its own): zero1 against the
    # same schedule's dense run, which is what these schedules compute (not one process's steps)
    "zero1-dp2-pp2-pipedream": ({"dp": 2, "pp": 2, "sharding": "zero1", "schedule": "pipedream"}, {}),
    "dense-dp2-pp2-pipedream": ({"dp": 2, "pp": 2, "schedule": "pipedream"}, {}),
    "zero1-dp2-pp2-2bw": ({"dp": 2, "pp": 2, "sharding": "zero1", "schedule": "2bw"}, {}),
    "dense-dp2-pp2-2bw": ({"dp": 2, "pp": 2, "schedule": "2bw"}, {}),
}
# The run each layout is compared with (default: "single").
REFERENCE = {"zero1-dp2-pp2-pipedream": "dense-dp2-pp2-pipedream", "zero1-dp2-pp2-2bw": "dense-dp2-pp2-2bw"}


def _launch(out: Path, nproc: int) -> None:
    runs = [{"name": name, "model": {**MODEL, "tied_embeddings": False} if name.startswith("untied") else MODEL,
             "fp64": True, "train": {**TRAIN, **extra},
             "parallel": {"global_batch": GLOBAL_BATCH, "microbatch": MICROBATCH, **layout}}
            for name, (layout, extra) in LAYOUTS.items()
            if layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) == nproc]
    spec = out / f"runs{nproc}.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = forkrun.command(nproc, str(HARNESS), str(spec))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, f"launch of {nproc} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharding")
    _launch(out, 1)
    _launch(out, 4)
    every = {}
    for name in LAYOUTS:
        rows = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        every[name] = {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
                       "params": torch.load(out / f"{name}.pt")}
    return every


@pytest.mark.parametrize("name", [n for n in LAYOUTS if not n.endswith("single") and not n.startswith("dense")])
def test_sharded_layout_trains_like_one_process(runs: dict[str, dict[str, Any]], name: str) -> None:
    run = runs[name]
    ref = runs[REFERENCE.get(name, "untied-single" if name.startswith("untied") else "single")]
    assert len(run["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=RTOL, atol=0)
    params, want = run["params"], ref["params"]
    assert params.keys() == want.keys()
    for key, value in want.items():
        assert params[key].dtype == torch.float64
        if key.endswith("attn.k.bias"):
            assert float(params[key].abs().max()) < KEY_BIAS_NOISE, key
            continue
        rel = float((params[key] - value).norm() / value.norm())
        assert rel <= RTOL, f"{key}: relative error {rel:.2e} > {RTOL:g}"


def test_training_moved_the_model(runs: dict[str, dict[str, Any]]) -> None:
    """The comparison above is not between untrained models."""
    assert runs["single"]["losses"][-1] < runs["single"]["losses"][0]
