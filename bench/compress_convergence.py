"""Convergence with gradient compression: the tiny GPT on 4 data-parallel ranks, dense all-reduce
against every compressor at one density, same seed, data and optimizer; a table and a PNG of the
loss curves.

    .venv/bin/python bench/compress_convergence.py                 # SGD with momentum, 300 steps, density 1 %
    .venv/bin/python bench/compress_convergence.py --optimizer adamw --lr 3e-3
    .venv/bin/python bench/compress_convergence.py --steps 100 --plot /tmp/loss.png

Each method is one ``paratrain train`` run (``run_training``, 4 gloo processes). The final loss
is the mean over the last ``--tail`` steps (one step's loss is one global batch: noisy);
"vs dense" is its relative difference to the dense run's. Issue 14's bar: Ok-Topk within 2 %.
"""

from __future__ import annotations

import argparse
import statistics

from paratrain.fileio import atomic_write_png, check_output_path
from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.launch import run_training

METHODS = ("none", "oktopk", "topka", "gtopk", "gaussiank", "powersgd")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default 0.3 with sgd, 3e-3 with adamw)")
    ap.add_argument("--warmup", type=int, default=5, help="dense steps before compression (--compress-warmup)")
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--plot", default="docs/img/compress_convergence.png")
    args = ap.parse_args()
    check_output_path(args.plot, "--plot")
    lr = args.lr if args.lr is not None else (0.3 if args.optimizer == "sgd" else 3e-3)
    curves: dict[str, list[float]] = {}
    for m in args.methods:
        cfg = ParallelConfig(dp=4, global_batch=args.global_batch, compression=m, compression_density=args.density)
        result = run_training("gpt-tiny", cfg, steps=args.steps, seed=0, lr=lr, optimizer=args.optimizer,
                              compress_warmup=args.warmup, progress=False, log_every=10**9)
        curves[m] = result.losses
    dense = statistics.fmean(curves["none"][-args.tail:]) if "none" in curves else None
    print(f"gpt-tiny, dp=4 (gloo), {args.steps} steps, global batch {args.global_batch}, {args.optimizer} lr {lr:g}, "
          f"density {args.density:g}, {args.warmup} dense warm-up steps; final = mean of the last {args.tail}")
    print("| method | final loss | vs dense |\n|---|---:|---:|")
    for m, losses in curves.items():
        final = statistics.fmean(losses[-args.tail:])
        rel = f"{100 * (final - dense) / dense:+.2f} %" if dense else "-"
        print(f"| {m if m != 'none' else 'dense'} | {final:.4f} | {rel} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for m, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=m if m != "none" else "dense all-reduce", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"gpt-tiny, 4 ranks, {args.optimizer}, density {args.density:g}")
    ax.legend()
    fig.tight_layout()
    atomic_write_png(args.plot, fig, "--plot")
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
