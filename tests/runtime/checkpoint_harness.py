"""Worker for the resharding test: one torchrun launch of 2 processes, several runs in turn.

Run by tests/runtime/test_checkpoint_reshard.py as
``python -m torch.distributed.run --nproc-per-node 2 tests/runtime/checkpoint_harness.py RUNS.json``.
``RUNS.json`` is ``{"out": DIR, "runs": [{"name", "parallel", "train", "copy_from", "drop_steps"}, ...]}``
(gpt-tiny in float64). Before a run, rank 0 copies the checkpoint directory ``copy_from`` (if
given) to the run's ``train.checkpoint_dir`` without the step directories in ``drop_steps`` (a
run killed after its checkpoint of step 4); each run writes ``DIR/<name>.jsonl`` (metrics) and
``DIR/<name>.pt`` (final parameters), as ``paratrain train`` would.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.mesh import init_runtime
from paratrain.runtime.metrics import MetricsWriter
from paratrain.runtime.train import TrainConfig, Trainer
from paratrain.spec.model import resolve_model


def main() -> None:
    doc = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    out = doc["out"]
    torch.set_num_threads(1)
    spec = resolve_model("gpt-tiny")
    for run in doc["runs"]:
        name = run["name"]
        train = TrainConfig(**{**run["train"], "metrics": f"{out}/{name}.jsonl", "save_final": f"{out}/{name}.pt",
                               "progress": False})
        cfg = ParallelConfig(**run["parallel"])
        ctx = init_runtime(cfg, timeout_s=train.timeout_s)
        if run.get("copy_from") and ctx.rank == 0:
            drop = shutil.ignore_patterns(*run.get("drop_steps", []))
            shutil.copytree(run["copy_from"], Path(train.checkpoint_dir or ""), ignore=drop)
        dist.barrier()
        torch.manual_seed(train.seed)
        torch.set_default_dtype(torch.float64)
        try:
            trainer = Trainer(ctx, spec, train)
            with MetricsWriter(train.metrics, ctx.rank) as writer:
                trainer.run(writer)
            trainer.finish()
        finally:
            torch.set_default_dtype(torch.float32)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
