"""Worker for the pipeline tests: one torchrun launch trains several schedules one after another.

Run by tests/runtime/test_pipeline_equivalence.py as
``python -m torch.distributed.run --nproc-per-node N tests/runtime/pipeline_harness.py --out DIR ...``.
For each ``--schedules`` entry (``name`` and any of the variants ``:untied``, ``:fp64`` — the model
and every tensor it makes in float64 — and ``:noprefetch``, every receive posted at its own
action, e.g. ``2bw:untied:fp64``) it
builds a fresh
:class:`~paratrain.runtime.train.Trainer` on the same process group, trains ``--steps`` steps and
rank 0 saves ``DIR/<name>.pt`` = {losses, grad_norms, params}. One launch per layout keeps the
process start-up (the slow part on a 2-core machine) out of the per-schedule cost.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.mesh import init_runtime
from paratrain.runtime.train import TrainConfig, Trainer
from paratrain.spec.model import preset

# 1 MiB of the standard library's sources: real text (random tokens give near-zero gradient
# elements whose Adam updates amplify fp32 summation-order differences), loaded in well under 1 s.
DATA_CAP_BYTES = 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--schedules", required=True)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--microbatch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--trace", action="store_true", help="also write DIR/<name>.trace.json (measured timeline)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = ParallelConfig(pp=a.pp, dp=a.dp, tp=a.tp, microbatch=a.microbatch, global_batch=a.global_batch)
    ctx = init_runtime(base, timeout_s=120)
    for entry in a.schedules.split(","):
        name, *variants = entry.split(":")
        # No biases: the key projection's bias has an identically zero gradient (softmax ignores a
        # constant added to every key), so its value would be rounding noise that Adam amplifies.
        spec = dataclasses.replace(preset("gpt-tiny"), layers=a.layers, tied_embeddings="untied" not in variants,
                                   bias=False)
        cfg = base.with_overrides(schedule=name, virtual_stages=2 if name == "interleaved" else 1)
        trace = f"{a.out}/{entry.replace(':', '-')}.trace.json" if a.trace and cfg.pp > 1 else None
        train = TrainConfig(steps=a.steps, seed=a.seed, lr=a.lr, data="stdlib", data_cap_bytes=DATA_CAP_BYTES,
                            progress=False, timeout_s=120, trace=trace,
                            prefetch_receives=0 if "noprefetch" in variants else None)
        torch.manual_seed(a.seed)
        torch.set_default_dtype(torch.float64 if "fp64" in variants else torch.float32)
        trainer = Trainer(dataclasses.replace(ctx, config=cfg), spec, train)
        rows = [trainer.train_step(k) for k in range(a.steps)]
        params = trainer.full_parameters()
        if trace is not None:
            trainer.finish()
        torch.set_default_dtype(torch.float32)
        if ctx.rank == 0:
            torch.save({"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
                        "params": params}, f"{a.out}/{entry.replace(':', '-')}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
