"""Convergence with gradient compression: the tiny GPT on 4 data-parallel ranks, dense all-reduce
against every compressor at one density, same seed, data and optimizer; a table and a PNG of the
loss curves.

    .venv/bin/python bench/compress_convergence.py                 # SGD with momentum, 300 steps, density 1 %
    .venv/bin/python bench/compress_convergence.py --lr-grid 0.03 0.1 0.3 --momentum-correction
    .venv/bin/python bench/compress_convergence.py --optimizer adamw --lr 3e-3
    .venv/bin/python bench/compress_convergence.py --steps 600 --methods none oktopk --plot /tmp/loss.png
    .venv/bin/python bench/compress_convergence.py --hidden 128 --seed 1 --methods none oktopk --momentum-correction

Each method is one ``paratrain train`` run (``run_training``, 4 gloo processes). The final loss
is the mean over the last ``--tail`` steps (one step's loss is one global batch: noisy);
"vs dense" is its relative difference to the dense run's. With ``--lr-grid`` the dense run is
made at every learning rate of the grid first and the compressors then run at the dense run's
best one (fair to dense). ``--momentum-correction`` (with ``--optimizer sgd``) gives the sparse
methods DGC's momentum correction, masking and local clipping (``--no-masking``: without
masking); ``--density-warmup N`` DGC's density ramp; PowerSGD keeps plain error feedback. Issue 14's
bar: Ok-Topk within 2 % of dense.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from paratrain.fileio import atomic_write_png, check_output_path
from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.launch import run_training
from paratrain.spec.model import from_document

METHODS = ("none", "oktopk", "topka", "gtopk", "gaussiank", "powersgd")
SPARSE = ("oktopk", "topka", "gtopk", "gaussiank")


def _train(method: str, lr: float, args: argparse.Namespace) -> list[float]:
    cfg = ParallelConfig(dp=4, global_batch=args.global_batch, compression=method, compression_density=args.density)
    dgc: dict[str, Any] = {}
    if method in SPARSE:
        dgc = {"compress_momentum_correction": args.momentum_correction, "compress_momentum_masking": args.masking,
               "compress_density_warmup": args.density_warmup}
    model = from_document({"preset": "gpt-tiny", "hidden": args.hidden}) if args.hidden else "gpt-tiny"
    result = run_training(model, cfg, steps=args.steps, seed=args.seed, lr=lr, optimizer=args.optimizer,
                          compress_warmup=args.warmup, progress=False, log_every=10**9, **dgc)
    return result.losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    ap.add_argument("--lr", type=float, default=None,
                    help="peak learning rate (default 0.1 with sgd, dense's best of 0.03/0.1/0.3; 3e-3 with adamw)")
    ap.add_argument("--lr-grid", type=float, nargs="+", default=None,
                    help="dense at each of these learning rates; the compressors at the best one")
    ap.add_argument("--warmup", type=int, default=5, help="dense steps before compression (--compress-warmup)")
    ap.add_argument("--momentum-correction", action="store_true", help="DGC's momentum correction (sgd only)")
    ap.add_argument("--no-masking", dest="masking", action="store_false", help="without momentum factor masking")
    ap.add_argument("--density-warmup", type=int, default=0, help="DGC's 25 %% -> density ramp, in steps")
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="initialisation and data seed of every run")
    ap.add_argument("--hidden", type=int, default=None, help="gpt-tiny with this hidden size (default its 64)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--plot", default="docs/img/compress_convergence.png")
    args = ap.parse_args()
    check_output_path(args.plot, "--plot")
    default_lr = 0.1 if args.optimizer == "sgd" else 3e-3
    grid = args.lr_grid or [args.lr if args.lr is not None else default_lr]

    def final(losses: list[float]) -> float:
        return statistics.fmean(losses[-args.tail:])

    curves: dict[str, list[float]] = {}
    lr = grid[0]
    if "none" in args.methods:
        by_lr = {g: _train("none", g, args) for g in grid}
        lr = min(grid, key=lambda g: final(by_lr[g]))
        curves["none"] = by_lr[lr]
        if len(grid) > 1:
            print("dense all-reduce, learning-rate sensitivity")
            print("| lr | final loss | vs best |\n|---:|---:|---:|")
            for g in grid:
                print(f"| {g:g} | {final(by_lr[g]):.4f} | {100 * (final(by_lr[g]) / final(by_lr[lr]) - 1):+.2f} % |")
    for m in args.methods:
        if m != "none":
            curves[m] = _train(m, lr, args)
    dgc = ""
    if args.momentum_correction:
        dgc = "; sparse methods with DGC momentum correction" + ("" if args.masking else " (no masking)")
    if args.density_warmup:
        dgc += f"; density ramp 25 % -> {args.density:g} over {args.density_warmup} steps"
    model = f"gpt-tiny (hidden {args.hidden})" if args.hidden else "gpt-tiny"
    print(f"{model}, dp=4 (gloo), seed {args.seed}, {args.steps} steps, global batch {args.global_batch}, "
          f"{args.optimizer} lr {lr:g}, "
          f"density {args.density:g}, {args.warmup} dense warm-up steps{dgc}; final = mean of the last {args.tail}")
    dense = final(curves["none"]) if "none" in curves else None
    print("| method | final loss | vs dense |\n|---|---:|---:|")
    for m, losses in curves.items():
        rel = f"{100 * (final(losses) - dense) / dense:+.2f} %" if dense else "-"
        print(f"| {m if m != 'none' else 'dense'} | {final(losses):.4f} | {rel} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for m, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=m if m != "none" else "dense all-reduce", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"gpt-tiny, 4 ranks, {args.optimizer} lr {lr:g}, density {args.density:g}{' + DGC' if dgc else ''}")
    ax.legend()
    fig.tight_layout()
    atomic_write_png(args.plot, fig, "--plot")
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
