"""Worker for the layout tests: one torchrun launch trains several layouts one after another.

Run by tests/runtime/test_runtime_equivalence.py as
``python -m torch.distributed.run --nproc-per-node N tests/runtime/layout_harness.py RUNS.json``.
``RUNS.json`` is ``{"out": DIR, "runs": [{"name", "model", "parallel", "train", "fp64"}, ...]}``:
``model`` a preset name or a ModelSpec mapping, ``parallel`` ParallelConfig fields, ``train``
TrainConfig fields; ``fp64`` builds the model (and so every tensor it makes) in float64. Each run
forms its own mesh on the launch's process group and goes through the step loop and its end of
run as ``paratrain train`` does (:meth:`Trainer.run`, :meth:`Trainer.finish`), writing
``DIR/<name>.jsonl`` (metrics), ``DIR/<name>.pt`` (final parameters) and, when ``train`` asks for
one, the trace. One launch per world size keeps process start-up, the slow part on a 2-core
machine, out of the per-layout cost.
"""

from __future__ import annotations

import json
import sys

import torch

from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.mesh import init_runtime
from paratrain.runtime.metrics import MetricsWriter
from paratrain.runtime.train import TrainConfig, Trainer
from paratrain.spec.model import from_document, resolve_model


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as fh:
        doc = json.load(fh)
    out = doc["out"]
    torch.set_num_threads(1)  # the same kernels, and roundings, whatever the machine's core count
    for run in doc["runs"]:
        name = run["name"]
        model = run["model"]
        spec = from_document(model) if isinstance(model, dict) else resolve_model(model)
        cfg = ParallelConfig(**run["parallel"])
        train = TrainConfig(**{**run["train"], "metrics": f"{out}/{name}.jsonl", "save_final": f"{out}/{name}.pt",
                               "progress": False})
        ctx = init_runtime(cfg, timeout_s=train.timeout_s)
        torch.manual_seed(train.seed)
        torch.set_default_dtype(torch.float64 if run["fp64"] else torch.float32)
        try:
            trainer = Trainer(ctx, spec, train)
            with MetricsWriter(train.metrics, ctx.rank) as writer:
                trainer.run(writer)
            trainer.finish()
        finally:
            torch.set_default_dtype(torch.float32)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
