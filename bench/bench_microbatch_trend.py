"""Does the model get the micro-batch trend right? vTrain's multi-node runs (Megatron-DeepSpeed on A100)
repeat one layout at several micro-batch sizes; the ratio of two such runs' step times is set by the
GEMM shapes (wave and tile quantization), the bubble and the per-kernel costs, not by the absolute
efficiencies the calibration scales.

    .venv/bin/python bench/bench_microbatch_trend.py              # every layout with 2+ micro-batch sizes
    .venv/bin/python bench/bench_microbatch_trend.py --hidden 12288   # GPT-3 175B's rows only

For each group of runs that differ only in the micro-batch (same model, GPUs, batch, tp, dp, pp),
prints each run's step time relative to the group's smallest micro-batch, measured and predicted
(the simulator with the A100's fitted calibration, as ``paratrain validate vtrain-multi
--calibration fitted``), and the error of that ratio; then the mean and largest |error| of the
ratios. The planner's GPT-3 175B winner (micro-batch 3 at tp 8, where the records ran micro-batch 1)
rests on the same shape model, so the 175B rows are the check that matters for it.

vtrain-multi is one of the sources the calibration was fitted on (five numbers for all A100 runs);
a ratio cancels what those numbers scale alike. Deterministic (no timing of this machine).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from paratrain.data import vtrain_path
from paratrain.plan.calibrated import CALIBRATIONS
from paratrain.plan.validate import megatron_predictor, parse_vtrain_csv, predict
from paratrain.spec.cluster import resolve_cluster


def trend_groups(runs, predicted):
    """``{(hidden, layers, gpus, batch, tp, dp, pp): [(mb, measured_s, predicted_s), ...]}`` for the
    layouts measured at two or more micro-batch sizes, each list sorted by micro-batch (a micro-batch
    measured twice keeps its first run)."""
    groups: dict[tuple[int, ...], dict[int, tuple[float, float]]] = defaultdict(dict)
    for r, p in zip(runs, predicted, strict=True):
        key = (r.hidden, r.layers, r.gpus, r.global_batch, r.tp, r.dp, r.pp)
        groups[key].setdefault(r.microbatch, (r.time_s, p))
    return {k: sorted((mb, t, p) for mb, (t, p) in v.items()) for k, v in groups.items() if len(v) >= 2}


def ratio_errors(points):
    """``[(mb, measured ratio, predicted ratio, error %)]`` against the smallest micro-batch."""
    _, t0, p0 = points[0]
    return [(mb, t / t0, p / p0, 100 * ((p / p0) / (t / t0) - 1)) for mb, t, p in points[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, help="only the rows of this hidden size (12288: GPT-3 175B)")
    args = ap.parse_args()
    runs = parse_vtrain_csv(vtrain_path("ground_truth_multi.csv").read_text(encoding="utf-8"), "vtrain-multi")
    if args.hidden is not None:
        runs = [r for r in runs if r.hidden == args.hidden]
        if not runs:
            ap.error(f"--hidden: no vtrain-multi row has hidden {args.hidden} (fix: use 3072, 6144, 8192 or 12288)")
    predicted = predict(runs, resolve_cluster("dgx-a100"), CALIBRATIONS["fitted-a100"], megatron_predictor("sim"))
    print(f"{'hidden':>6} {'GPUs':>5} {'tp':>3} {'dp':>3} {'pp':>3} {'mb':>6} {'measured':>9} {'predicted':>10}"
          f" {'error':>7}")
    errors = []
    for (hidden, _layers, gpus, _batch, tp, dp, pp), points in sorted(trend_groups(runs, predicted).items()):
        for mb, meas, pred, err in ratio_errors(points):
            errors.append(err)
            print(f"{hidden:6d} {gpus:5d} {tp:3d} {dp:3d} {pp:3d} {points[0][0]:>2}→{mb:<3d} {meas:9.3f} {pred:10.3f}"
                  f" {err:+6.1f}%")
    print(f"{len(errors)} ratios: mean |error| {sum(map(abs, errors)) / len(errors):.1f}%, "
          f"largest {max(map(abs, errors)):.1f}%, mean signed {sum(errors) / len(errors):+.1f}%")


if __name__ == "__main__":
    main()
