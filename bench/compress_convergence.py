"""Convergence with gradient compression: the tiny GPT on 4 data-parallel ranks, dense all-reduce
against every compressor at one density, same seed, data and optimizer; a table and a PNG of the
loss curves.

    .venv/bin/python bench/compress_convergence.py                 # SGD with momentum, 300 steps, density 1 %
    .venv/bin/python bench/compress_convergence.py --lr-grid 0.03 0.1 0.3 --momentum-correction   # README's table
    .venv/bin/python bench/compress_convergence.py --lr 0.1 --momentum-correction --no-lr-weighted-residual
    .venv/bin/python bench/compress_convergence.py --optimizer adamw --lr 3e-3
    .venv/bin/python bench/compress_convergence.py --steps 600 --methods none oktopk --plot /tmp/loss.png
    .venv/bin/python bench/compress_convergence.py --hidden 128 --seed 1 --methods none oktopk --momentum-correction

Each method is one ``paratrain train`` run (``run_training``, 4 gloo processes). The measure is
the held-out loss after the last step (``eval_loss``: the same ``--eval-batches`` global batches
for every method, taken from the standard library's bytes after the 8 MiB the training samples
from), and beside it the training loss averaged over the last ``--tail`` steps (one step's
loss is one global batch: noisy); "vs dense" is the relative difference to the dense run's.
With ``--lr-grid`` every method runs at every learning rate of the grid and is compared at its
own best (``--dense-lr-only``: the compressors only at dense's best). ``--momentum-correction``
(with ``--optimizer sgd``) gives the sparse methods DGC's momentum correction, masking and local
clipping (``--no-masking``: without masking); ``--density-warmup N`` DGC's density ramp;
``--no-lr-weighted-residual`` the residuals in raw gradient units (runtime/compress/momentum.py,
``ResidualLrScaling``); PowerSGD keeps plain error feedback. The achieved density (mean over the
compressed steps of rank 0's selected fraction) is printed for each sparse run. Issue 14's bar:
Ok-Topk within 2 % of dense.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from paratrain.fileio import atomic_write_bytes, atomic_write_png, check_output_path
from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.launch import run_training
from paratrain.spec.model import from_document

METHODS = ("none", "oktopk", "topka", "gtopk", "gaussiank", "powersgd")
SPARSE = ("oktopk", "topka", "gtopk", "gaussiank")


TRAIN_CAP_BYTES = 8 * 2**20  # what --data stdlib samples from (TrainConfig.data_cap_bytes)
HELD_OUT_BYTES = 2**20


def held_out_file(directory: str) -> str:
    """The standard library's bytes after the training corpus's first 8 MiB, as a file: text of the
    same kind that no training step samples."""
    from paratrain.runtime.data.text import load_corpus

    tokens = load_corpus("stdlib", TRAIN_CAP_BYTES + HELD_OUT_BYTES).tokens
    assert tokens is not None and tokens.numel() > TRAIN_CAP_BYTES, "the standard library is under 9 MiB here"
    path = str(Path(directory) / "held_out.txt")
    atomic_write_bytes(path, tokens[TRAIN_CAP_BYTES:].numpy().tobytes(), "held-out data")
    return path


class Run:
    """One training run's curve and measures."""

    def __init__(self, rows: tuple[dict[str, Any], ...], tail: int) -> None:
        self.losses = [r["loss"] for r in rows]
        self.train = statistics.fmean(self.losses[-tail:])
        self.eval = float(rows[-1]["eval_loss"])
        sparse = [r["density"] for r in rows if r.get("density") is not None]
        self.density = statistics.fmean(sparse) if sparse else None


def _train(method: str, lr: float, args: argparse.Namespace, eval_data: str) -> Run:
    cfg = ParallelConfig(dp=4, global_batch=args.global_batch, compression=method, compression_density=args.density)
    dgc: dict[str, Any] = {}
    if method in SPARSE:
        dgc = {"compress_momentum_correction": args.momentum_correction, "compress_momentum_masking": args.masking,
               "compress_density_warmup": args.density_warmup,
               "compress_lr_weighted_residual": args.lr_weighted_residual}
    model = from_document({"preset": "gpt-tiny", "hidden": args.hidden}) if args.hidden else "gpt-tiny"
    result = run_training(model, cfg, steps=args.steps, seed=args.seed, lr=lr, optimizer=args.optimizer,
                          compress_warmup=args.warmup, progress=False, log_every=10**9, eval_data=eval_data,
                          eval_batches=args.eval_batches, **dgc)
    return Run(result.rows, args.tail)


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
    ap.add_argument("--no-lr-weighted-residual", dest="lr_weighted_residual", action="store_false",
                    help="residuals in raw gradient units (--no-compress-lr-weighted-residual)")
    ap.add_argument("--dense-lr-only", action="store_true",
                    help="with --lr-grid: the compressors at dense's best learning rate only")
    ap.add_argument("--eval-batches", type=int, default=16, help="held-out global batches of the measure")
    ap.add_argument("--tail", type=int, default=20, help="steps of the training-loss mean")
    ap.add_argument("--seed", type=int, default=0, help="initialisation and data seed of every run")
    ap.add_argument("--hidden", type=int, default=None, help="gpt-tiny with this hidden size (default its 64)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--plot", default="docs/img/compress_convergence.png")
    args = ap.parse_args()
    check_output_path(args.plot, "--plot")
    default_lr = 0.1 if args.optimizer == "sgd" else 3e-3
    grid = args.lr_grid or [args.lr if args.lr is not None else default_lr]

    with tempfile.TemporaryDirectory() as tmp:
        eval_data = held_out_file(tmp)
        runs: dict[str, dict[float, Run]] = {}
        dense_lr = grid[0]
        if "none" in args.methods:
            runs["none"] = {g: _train("none", g, args, eval_data) for g in grid}
            dense_lr = min(grid, key=lambda g: runs["none"][g].eval)
        for m in args.methods:
            if m != "none":
                own = [dense_lr] if args.dense_lr_only else grid
                runs[m] = {g: _train(m, g, args, eval_data) for g in own}
    best = {m: min(by_lr, key=lambda g: by_lr[g].eval) for m, by_lr in runs.items()}
    dgc = ""
    if args.momentum_correction:
        dgc = "; sparse methods with DGC momentum correction" + ("" if args.masking else " (no masking)")
    if args.density_warmup:
        dgc += f"; density ramp 25 % -> {args.density:g} over {args.density_warmup} steps"
    if not args.lr_weighted_residual:
        dgc += "; residuals in raw gradient units"
    model = f"gpt-tiny (hidden {args.hidden})" if args.hidden else "gpt-tiny"
    print(f"{model}, dp=4 (gloo), seed {args.seed}, {args.steps} steps, global batch {args.global_batch}, "
          f"{args.optimizer}, density {args.density:g}, {args.warmup} dense warm-up steps{dgc}; eval = held-out "
          f"loss after the last step ({args.eval_batches} global batches), train = mean of the last {args.tail} "
          f"steps' loss")
    dense = runs["none"][best["none"]] if "none" in runs else None
    if len(grid) > 1:
        print("\nevery run (eval loss; train loss in brackets)")
        print("| method | " + " | ".join(f"lr {g:g}" for g in grid) + " |\n|---|" + "---:|" * len(grid))
        for m, by_lr in runs.items():
            cells = [f"{by_lr[g].eval:.4f} ({by_lr[g].train:.4f})" if g in by_lr else "-" for g in grid]
            print(f"| {m if m != 'none' else 'dense'} | " + " | ".join(cells) + " |")
    print("\neach method at its best learning rate" + (" (compressors at dense's)" if args.dense_lr_only else ""))
    print("| method | lr | eval loss | vs dense | train loss | vs dense | density |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m, by_lr in runs.items():
        r = by_lr[best[m]]
        ev = f"{100 * (r.eval / dense.eval - 1):+.2f} %" if dense else "-"
        tr = f"{100 * (r.train / dense.train - 1):+.2f} %" if dense else "-"
        dens = f"{100 * r.density:.3f} %" if r.density is not None and m in SPARSE else "-"
        name = m if m != "none" else "dense"
        print(f"| {name} | {best[m]:g} | {r.eval:.4f} | {ev} | {r.train:.4f} | {tr} | {dens} |")
    curves = {m: by_lr[best[m]].losses for m, by_lr in runs.items()}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for m, losses in curves.items():
        name = m if m != "none" else "dense all-reduce"
        ax.plot(range(1, len(losses) + 1), losses, label=f"{name} (lr {best[m]:g})", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    dgc_tag = " + DGC" if args.momentum_correction else ""
    ax.set_title(f"{model}, 4 ranks, {args.optimizer}, density {args.density:g}{dgc_tag}")
    ax.legend()
    fig.tight_layout()
    atomic_write_png(args.plot, fig, "--plot")
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
