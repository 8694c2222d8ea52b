"""One reduction of a large fp32 gradient on 4 gloo ranks: Ok-Topk against dense all-reduce, TopkA,
gTop-k, Gaussiank and PowerSGD (rank 4), at each density, in the same run (issue 14).

    .venv/bin/python bench/bench_compress.py                       # 25M elements, densities 1 % and 0.1 %
    .venv/bin/python bench/bench_compress.py --elements 2000000 --reps 3

Each rank holds a gradient of ``--elements`` fp32 values drawn fresh for every call (outside the
timing) from a heavy-tailed distribution (a Gaussian times the exponential of a Gaussian:
gradients' tails are heavier than Gaussian, which is what Gaussiank's estimate misses). One call
= one ``reduce`` of the whole gradient, residual included; the time of a call is the slowest
rank's. Each method runs ``--warmup`` untimed calls (Ok-Topk's first call computes its thresholds
and regions exactly, later calls reuse them as in training), then ``--reps`` timed ones; the figure
is their median. PowerSGD sees the gradient as square matrices of ``--matrix`` rows. Methods
alternate within each repetition so slow drifts of a shared machine hit all of them.
"select only" is the floor of every sparse method on this host: adding the residual and one pass
finding the entries above a threshold, on all ranks at once, no communication. The last line of
each density: the link bandwidth below which Ok-Topk, with its whole time here counted as
overhead, would beat a dense ring all-reduce (volumes from paratrain.cost.compress).
Target: Ok-Topk faster than dense at <= 1 % and faster than TopkA.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

METHODS = ("dense", "oktopk", "topka", "gtopk", "gaussiank", "powersgd")


def _gradient(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen))


def _worker(rank: int, world: int, args: argparse.Namespace, rdzv: str, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    from paratrain.runtime.compress import make_compressor

    n = args.elements
    rows = args.matrix
    shapes = [torch.Size([rows, rows])] * (n // (rows * rows)) + (
        [torch.Size([n % (rows * rows)])] if n % (rows * rows) else [])
    gen = torch.Generator().manual_seed(rank)
    results: dict[tuple[str, float], list[float]] = {}
    sent: dict[tuple[str, float], int] = {}
    for density in args.densities:
        comps = {m: (None if m == "dense" else make_compressor(m, None, density, shapes)) for m in METHODS}
        for rep in range(args.warmup + args.reps):
            for m in METHODS:
                if m == "powersgd" and density != args.densities[0]:
                    continue  # its volume does not depend on the density: measured once
                g = _gradient(n, gen)
                dist.barrier()
                start = time.perf_counter()
                if comps[m] is None:
                    dist.all_reduce(g)
                    elements = round(2 * n * (world - 1) / world)
                else:
                    elements = comps[m].reduce(g).elements_sent
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if rep >= args.warmup:
                    results.setdefault((m, density), []).append(float(elapsed))
                    sent[(m, density)] = max(sent.get((m, density), 0), elements)
    # the floor of any sparse method here: one pass adding the residual and one finding the entries
    # above a threshold (Ok-Topk's reused-threshold selection), no communication, all ranks at once
    from paratrain.runtime.compress.select import Scratch, sampled_threshold

    scratch, residual = Scratch(), torch.zeros(n)
    for density in args.densities:
        for rep in range(args.warmup + args.reps):
            g = _gradient(n, gen)
            thr = sampled_threshold(g, max(1, math.ceil(n * density)))
            dist.barrier()
            start = time.perf_counter()
            scratch.above(residual.add_(g), thr)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            residual.zero_()
            if rep >= args.warmup:
                results.setdefault(("select only", density), []).append(float(elapsed))
                sent[("select only", density)] = 0
    if rank == 0:
        queue.put((results, sent))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=25_000_000)
    ap.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--matrix", type=int, default=1000, help="PowerSGD's matrix rows (square matrices)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args.ranks, args, os.path.join(tmp, "rdzv"), queue), nprocs=args.ranks, join=True)
    results, sent = queue.get()
    n, p = args.elements, args.ranks
    print(f"one reduction of {n:,} fp32 elements on {p} gloo ranks (1 thread each), median of {args.reps} "
          f"after {args.warmup} warm-up call(s); torch {torch.__version__}, {os.cpu_count()} CPU cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    dense = statistics.median(results[("dense", args.densities[0])])
    for density in args.densities:
        k = max(1, math.ceil(n * density))
        print(f"\ndensity {density:g} (k = {k:,}; Ok-Topk bound 6k(P-1)/P = {6 * k * (p - 1) / p:,.0f} elements)")
        print(f"{'method':<11} {'median s':>10} {'dense/this':>11} {'this/oktopk':>12} {'elements sent/rank':>19}")
        ok = statistics.median(results[("oktopk", density)])
        for m in (*METHODS, "select only"):
            key = (m, density if (m, density) in results else args.densities[0])
            t = statistics.median(results[key])
            print(f"{m:<11} {t:>10.3f} {dense / t:>11.2f} {t / ok:>12.2f} {sent[key]:>19,}")
        # where the trade turns on a real link of bandwidth B: dense sends its volume at B; Ok-Topk
        # sends its bound at B plus, at most, its whole time here (selection, index work and
        # shared-memory transfers counted as overhead); alpha terms are negligible at this size
        from paratrain.cost.compress import volume_elements

        dense_bytes = volume_elements("none", n, density, p) * 4
        ok_bytes = volume_elements("oktopk", n, density, p) * 4  # fp32 values, int32 indices
        print(f"Ok-Topk beats dense all-reduce on links below {(dense_bytes - ok_bytes) / ok / 1e9:.2f} GB/s "
              f"({(dense_bytes - ok_bytes) * 8 / ok / 1e9:.1f} Gbit/s) with this host's selection cost")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
