"""Held-out check of the data-parallel terms at scale: MegaScale's Megatron-LM baseline (Jiang et al.,
NSDI'24, table 2), GPT-3 175B on 256 to 12,288 Ampere GPUs, predicted by the simulator (issue 12).

    .venv/bin/python bench/bench_megascale.py                   # today's model
    .venv/bin/python bench/bench_megascale.py --overlap         # with Megatron-Core's bucketed overlap

The published layout: tp 8, pp 8, the interleaved schedule with 6 chunks per rank, sequence 2,048,
vocabulary 64,000, batch 768 (256–1,024 GPUs) or 6,144 (3,072–12,288 GPUs), so dp = GPUs / 64 goes
from 4 to 192 (MegaScale sec. 6.1). Not published, assumed here: micro-batch 1, selective
recomputation, sequence parallelism, the distributed optimizer (ZeRO-1), flash attention (the
default for the A100), and no data-parallel overlap: MegaScale's ablation (table 3) gains 1.5 % MFU
by adding it to this baseline. The A100 preset with its fitted calibration (``dgx-a100``; 8 × 200
Gb/s HDR per node). None of these rows was used to fit anything: the calibration is fitted on the
vTrain and public-runs sources, the per-rank spread of cost.dp_reduction comes from Sinha et al.
2022 and the overlap slowdown from arXiv 2507.03114.
Prints each row's measured and predicted iteration time and MFU, the error, and the mean and
largest |error|; then, per batch size, each column split by least squares into a cost per
micro-batch of a pipeline and a fixed cost per step (``time = per_microbatch * m + fixed`` over the
rows' ``m = batch / dp``): the split shows whether the model misses work that grows with the
micro-batches (compute, p2p) or a per-step cost (bubble, data-parallel reduction, optimizer).
Deterministic (no timing of this machine).
"""

from __future__ import annotations

import argparse

import numpy as np

from paratrain.parallel.config import ParallelConfig, Recompute, ScheduleName
from paratrain.plan.calibrated import FITTED_BY_DEVICE
from paratrain.plan.validate import with_calibration
from paratrain.sim.report import simulate_config
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import ModelSpec

# (batch, GPUs, iteration time s, MFU): MegaScale table 2, the Megatron-LM rows.
TABLE_2 = (
    (768, 256, 40.0, 0.530), (768, 512, 21.2, 0.499), (768, 768, 15.2, 0.467), (768, 1024, 11.9, 0.447),
    (6144, 3072, 29.02, 0.487), (6144, 6144, 14.78, 0.478), (6144, 8192, 12.24, 0.433),
    (6144, 12288, 8.57, 0.412),
)
MODEL = ModelSpec(layers=96, hidden=12288, heads=96, seq=2048, vocab=64000, name="gpt3-175b (MegaScale)")


def fixed_and_per_microbatch(microbatches: list[int], times_s: list[float]) -> tuple[float, float]:
    """``(per_microbatch_s, fixed_s)`` of the least-squares line ``time = per_microbatch_s * m + fixed_s``
    through ``(m, time)`` points; at least two distinct ``m``."""
    if len(microbatches) != len(times_s) or len(set(microbatches)) < 2:
        raise ValueError("need at least two distinct micro-batch counts, one time each")
    slope, intercept = np.polyfit(microbatches, times_s, 1)
    return float(slope), float(intercept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overlap", action="store_true", help="bucketed data-parallel overlap (Megatron-Core)")
    args = ap.parse_args()
    errors = []
    by_batch: dict[int, list[tuple[int, float, float]]] = {}
    print(f"{'batch':>6} {'GPUs':>6} {'dp':>4} {'measured':>9} {'predicted':>10} {'error':>7} {'MFU meas':>9}"
          f" {'pred':>6}")
    for batch, gpus, measured_s, mfu in TABLE_2:
        base = resolve_cluster("dgx-a100", gpus=gpus)
        cluster = with_calibration(base, FITTED_BY_DEVICE[base.device.name])
        config = ParallelConfig(
            dp=gpus // 64, tp=8, pp=8, microbatch=1, global_batch=batch, schedule=ScheduleName.INTERLEAVED,
            virtual_stages=6, recompute=Recompute.SELECTIVE, sequence_parallel=True, sharding="zero1",
        )
        res = simulate_config(MODEL, cluster, config, overlap_grad_reduce=args.overlap)
        err = 100 * (res.iteration_time_s / measured_s - 1)
        errors.append(err)
        by_batch.setdefault(batch, []).append((batch // (gpus // 64), measured_s, res.iteration_time_s))
        print(f"{batch:6d} {gpus:6d} {gpus // 64:4d} {measured_s:8.2f}s {res.iteration_time_s:9.2f}s {err:+6.1f}% "
              f"{100 * mfu:8.1f}% {100 * res.mfu:5.1f}%")
    print(f"mean |error| {sum(abs(e) for e in errors) / len(errors):.1f}%, largest {max(abs(e) for e in errors):.1f}%, "
          f"mean signed {sum(errors) / len(errors):+.1f}%")
    for batch, points in by_batch.items():
        ms = [m for m, _, _ in points]
        meas = fixed_and_per_microbatch(ms, [t for _, t, _ in points])
        pred = fixed_and_per_microbatch(ms, [t for _, _, t in points])
        print(f"batch {batch}, m = {min(ms)}..{max(ms)} micro-batches per pipeline: measured "
              f"{meas[0] * 1e3:.1f} ms per micro-batch + {meas[1]:.2f} s per step; "
              f"predicted {pred[0] * 1e3:.1f} ms + {pred[1]:.2f} s")


if __name__ == "__main__":
    main()
