"""Worker for tests/runtime/test_hf_weights.py: one training step of HF models under a layout.

Run as ``python -m torch.distributed.run --nproc-per-node N tests/runtime/hf_harness.py RUNS.json``;
``RUNS.json`` is ``{"out": DIR, "runs": [{"name", "dir", "seq", "parallel"}, ...]}``. Each run
builds a :class:`Trainer` in float64 with ``--init pretrained`` from the HF directory ``dir`` (the
weights go into the full model, which the layout then cuts and shards) and runs step 0 through
the step loop. The gradients are taken when the optimizer is about to step (reduced, and with
``grad_clip`` infinite, unscaled), gathered to full tensors by full-model name, and rank 0 writes
``DIR/<name>.pt``: the step's loss, its batch, the gradients and, without a pipeline, the logits
of the batch (the vocabulary-sharded output of tensor parallelism, gathered).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.checkpoint.state import named_parameters
from paratrain.runtime.mesh import init_runtime
from paratrain.runtime.train import TrainConfig, Trainer
from paratrain.spec.model import resolve_model


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def run_one(run: dict[str, Any], out: str) -> None:
    spec = resolve_model(run["dir"], seq=run["seq"])
    cfg = ParallelConfig(**run["parallel"])
    train = TrainConfig(steps=1, seed=0, grad_clip=math.inf, data="synthetic", init="pretrained",
                        init_from=run["dir"], progress=False, timeout_s=120)
    ctx = init_runtime(cfg, timeout_s=train.timeout_s)
    torch.manual_seed(train.seed)
    torch.set_default_dtype(torch.float64)
    try:
        trainer = Trainer(ctx, spec, train)
        grads: dict[str, torch.Tensor] = {}
        step = trainer.optimizer.step

        def capture_then_step() -> None:  # the tp ranks of a stage reach this together (full_tensor)
            for name, copies in sorted(named_parameters(trainer).items()):
                grads[name] = _full(copies[0].grad)
            step()

        trainer.optimizer.step = capture_then_step  # type: ignore[method-assign]
        batch = trainer._batch(0)
        logits = None
        if cfg.pp == 1:
            from paratrain.runtime.tensor_parallel import loss_context

            with torch.no_grad(), loss_context(cfg.tp):
                logits = torch.stack([_full(trainer.executor.model(batch.microbatch(i)[0]))
                                      for i in range(batch.num_microbatches)])
        row = trainer.train_step(0)
    finally:
        torch.set_default_dtype(torch.float32)
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, grads)
    if ctx.rank == 0:
        merged: dict[str, torch.Tensor] = {}
        for g in gathered:
            for k, v in g.items():
                merged.setdefault(k, v)
        torch.save({"loss": row["loss"], "grads": merged, "logits": logits, "inputs": batch.inputs,
                    "targets": batch.targets}, f"{out}/{run['name']}.pt")


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as fh:
        doc = json.load(fh)
    torch.set_num_threads(1)
    for run in doc["runs"]:
        run_one(run, doc["out"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
