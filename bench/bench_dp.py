"""Throughput of paratrain's data parallelism against torch's DistributedDataParallel, and of
dp=2 x tp=2 against dp=4, on the same model, data and process count, in the same run.

    .venv/bin/python bench/bench_dp.py                     # defaults below, CPU/gloo
    .venv/bin/python bench/bench_dp.py --layers 4 --hidden 256 --steps 12 --repeats 3

Each configuration is a separate ``run_training`` launch (elastic launcher, one thread per
process on this machine); configurations alternate over ``--repeats`` rounds so slow drifts of a
shared machine hit both sides. The figure per launch is the median tokens/s over its steps after
``--warmup`` steps; the ratio is taken between the medians over rounds, and the side that runs
first alternates between rounds. Target: paratrain/DDP >= 0.95.
"""

from __future__ import annotations

import argparse
import statistics

from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.launch import run_training
from paratrain.spec.model import preset


def _tokens_per_s(model, config, args, **opts) -> float:
    result = run_training(model, config, steps=args.steps, data="synthetic", progress=False,
                          log_every=10**9, seed=0, **opts)
    return statistics.median(result.tokens_per_s[args.warmup:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatch", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=2, help="micro-batches per replica and step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-tp", action="store_true", help="only the paratrain-vs-DDP comparison")
    args = ap.parse_args()
    model = preset("gpt-tiny").with_overrides(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                               seq=args.seq, name="bench-gpt")
    print(f"model: {model.param_count():,} parameters (layers {args.layers}, hidden {args.hidden}, seq {args.seq}),"
          f" synthetic data, fp32, micro-batch {args.microbatch} x {args.accumulation} per replica")

    def cfg(dp: int, tp: int = 1) -> ParallelConfig:
        return ParallelConfig(dp=dp, tp=tp, microbatch=args.microbatch,
                              global_batch=dp * args.microbatch * args.accumulation)

    ours, ddp = [], []
    for r in range(args.repeats):
        # Alternate which side runs first, so a load change during a round favours neither.
        for impl in ("paratrain", "ddp") if r % 2 == 0 else ("ddp", "paratrain"):
            (ours if impl == "paratrain" else ddp).append(_tokens_per_s(model, cfg(2), args, dp_impl=impl))
        print(f"round {r}: dp=2 paratrain {ours[-1]:,.0f} tokens/s, DDP {ddp[-1]:,.0f} tokens/s")
    o, d = statistics.median(ours), statistics.median(ddp)
    print(f"dp=2 (2 processes): paratrain {o:,.0f} tokens/s, DistributedDataParallel {d:,.0f} tokens/s, "
          f"ratio {o / d:.3f} (target >= 0.95)")
    if args.skip_tp:
        return
    dp4, dp2tp2 = [], []
    both = {"dp4": cfg(4), "dp2tp2": ParallelConfig(dp=2, tp=2, microbatch=args.microbatch,
                                                     global_batch=4 * args.microbatch * args.accumulation)}
    for r in range(args.repeats):
        for name in ("dp4", "dp2tp2") if r % 2 == 0 else ("dp2tp2", "dp4"):
            (dp4 if name == "dp4" else dp2tp2).append(_tokens_per_s(model, both[name], args))
        print(f"round {r}: dp=4 {dp4[-1]:,.0f} tokens/s, dp=2 x tp=2 {dp2tp2[-1]:,.0f} tokens/s")
    a, b = statistics.median(dp4), statistics.median(dp2tp2)
    print(f"4 processes, same global batch: dp=4 {a:,.0f} tokens/s, dp=2 x tp=2 {b:,.0f} tokens/s, "
          f"ratio (dp2xtp2 / dp4) {b / a:.3f}")


if __name__ == "__main__":
    main()
