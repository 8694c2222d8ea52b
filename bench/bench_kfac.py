"""K-FAC in pipeline bubbles (PipeFisher) on the tiny GPT: steps to a target loss against AdamW, and
the wall-clock cost of the fillers against the same schedule without them.

    .venv/bin/python bench/bench_kfac.py                                   # 200 steps, pp=2 x dp=2, 1F1B
    .venv/bin/python bench/bench_kfac.py --steps 60 --plot /tmp/kfac.png
    .venv/bin/python bench/bench_kfac.py --steps 30 --layers 4 --hidden 256 --plot /tmp/k.png  # larger factors

Four ``paratrain train`` runs on 4 gloo processes (pp=2 × dp=2), same seed and data:

* ``adamw``: the schedule as it is (no fillers);
* ``kfac-fill``: K-FAC whose pieces run where the fill pass (``paratrain.sim.fill``, the ``cpu``
  cluster's cost model, as ``train --fill-bubbles``) placed them; the refresh interval is the pass's;
* ``kfac-at-U``: K-FAC with the same refresh interval, every piece at the optimizer step of the
  cycle's first step (the same schedule without fillers, same numbers);
* ``sgd``: the K-FAC run's base optimizer alone (SGD with momentum, same lr, K-FAC never active):
  what the preconditioning adds.

Steps to a target: the first step whose loss, averaged over the last ``--window`` steps, is at or
below it (``--targets``, and the AdamW run's final windowed loss). Step time: the mean of the
per-step wall time after ``--skip`` steps (K-FAC at ``U`` puts a cycle's work on one step in
``refresh``, which a median would hide; the median is printed too). On a shared machine the times
are noisy: the script prints the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from paratrain.fileio import atomic_write_png, check_output_path
from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.launch import run_training
from paratrain.sim.fill import fill_kfac_config
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import resolve_model


def windowed(losses: list[float], w: int) -> list[float]:
    return [statistics.fmean(losses[max(0, i + 1 - w): i + 1]) for i in range(len(losses))]


def steps_to(losses: list[float], target: float, w: int) -> int | None:
    return next((i + 1 for i, v in enumerate(windowed(losses, w)) if i + 1 >= w and v <= target), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--layers", type=int, default=None, help="gpt-tiny with more layers (default 2)")
    ap.add_argument("--hidden", type=int, default=None, help="gpt-tiny wider (default 64; larger factors)")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--adamw-lr", type=float, default=3e-3)
    ap.add_argument("--kfac-lr", type=float, default=0.3)
    ap.add_argument("--kfac-damping", type=float, default=0.1)
    ap.add_argument("--targets", default="3.2,3.0,2.8", help="losses to reach (comma-separated); AdamW's final "
                    "windowed loss is added")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--skip", type=int, default=5, help="steps left out of the step-time median")
    ap.add_argument("--plot", default="docs/img/kfac_convergence.png")
    ap.add_argument("--json", default=None, help="write the curves and step times here")
    args = ap.parse_args()
    check_output_path(args.plot, "--plot")
    spec = resolve_model("gpt-tiny", layers=args.layers, hidden=args.hidden)
    cfg = ParallelConfig(pp=2, dp=2, microbatch=1, global_batch=args.global_batch, schedule=args.schedule)
    fill = fill_kfac_config(spec, resolve_cluster("cpu", nodes=1, gpus=cfg.world_size), cfg)
    refresh, filled = fill.refresh_steps, json.dumps(fill.filled.to_dict())
    common = {"seed": 0, "progress": False, "log_every": 10**9, "data": "stdlib"}
    kfac = {**common, "optimizer": "kfac", "lr": args.kfac_lr, "kfac_damping": args.kfac_damping}
    runs = {
        "adamw": {**common, "lr": args.adamw_lr},
        "kfac-fill": {**kfac, "kfac_refresh": refresh, "kfac_filled": filled},
        "kfac-at-U": {**kfac, "kfac_refresh": refresh},
        "sgd": {**kfac, "kfac_refresh": args.steps + 1},  # cycle 0 lasts the whole run: no inverses
    }
    rows: dict[str, list[dict]] = {}
    for name, opts in runs.items():
        rows[name] = list(run_training(spec, cfg, steps=args.steps, **opts).rows)
    losses = {n: [r["loss"] for r in rs] for n, rs in rows.items()}
    # the mean: K-FAC at U puts a cycle's work on one step in `refresh`, which a median would hide
    step_s = {n: statistics.fmean(r["step_time_s"] for r in rs[args.skip:]) for n, rs in rows.items()}
    median_s = {n: statistics.median(r["step_time_s"] for r in rs[args.skip:]) for n, rs in rows.items()}
    targets = [float(x) for x in args.targets.split(",") if x] + [round(windowed(losses["adamw"], args.window)[-1], 3)]
    load = os.getloadavg()
    print(f"{spec.name} (layers {spec.layers}, hidden {spec.hidden}), pp=2 x dp=2 ({args.schedule}, gloo, 4 "
          f"processes), global batch {args.global_batch}, "
          f"{cfg.num_microbatches} micro-batches per replica, {args.steps} steps; K-FAC refresh every {refresh} steps "
          f"(fill pass, cpu cluster), damping {args.kfac_damping:g}, SGD lr {args.kfac_lr:g}; AdamW lr "
          f"{args.adamw_lr:g}; load average {load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores")
    print(f"losses windowed over {args.window} steps; the last target is AdamW's final loss")
    print("| run | " + " | ".join(f"steps to {t:g}" for t in targets)
          + " | final loss | mean step (s) | median step (s) | vs adamw | vs kfac-at-U |")
    print("|---|" + "---:|" * (len(targets) + 5))
    for n in runs:
        reach = [steps_to(losses[n], t, args.window) for t in targets]
        cells = " | ".join(str(st) if st is not None else f"> {args.steps}" for st in reach)
        print(f"| {n} | {cells} | {windowed(losses[n], args.window)[-1]:.4f} "
              f"| {step_s[n]:.4f} | {median_s[n]:.4f} | {step_s[n] / step_s['adamw']:.3f} "
              f"| {step_s[n] / step_s['kfac-at-U']:.3f} |")
    if args.json:
        from paratrain.fileio import atomic_write_text

        times = {n: [r["step_time_s"] for r in rs] for n, rs in rows.items()}
        atomic_write_text(args.json, json.dumps({"losses": losses, "step_time_s": times, "refresh": refresh,
                                                 "targets": targets}), "--json")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, ls in losses.items():  # kfac-fill dashed: it lies on kfac-at-U (the same numbers)
        fill = n == "kfac-fill"
        ax.plot(range(1, len(ls) + 1), windowed(ls, args.window), label=n, lw=1.5 if fill else 1,
                ls="--" if fill else "-", zorder=3 if fill else 2)
    ax.axhline(targets[-1], color="grey", ls=":", lw=1, label="AdamW's final loss")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of last {args.window} steps)")
    ax.set_title(f"gpt-tiny, pp=2 x dp=2 {args.schedule}: K-FAC in bubbles (refresh {refresh}) vs AdamW")
    ax.legend()
    fig.tight_layout()
    atomic_write_png(args.plot, fig, "--plot")
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
