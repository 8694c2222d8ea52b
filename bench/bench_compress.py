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
"select only" is the floor of every sparse method on this host: the one pass that adds the
gradient into the residual, clears the gradient and finds the entries above a threshold
(``select.accumulate_above``, a compiled loop on the CPU), on all ranks at once, no communication.

``--stream drift`` replaces the i.i.d. draws by one slowly drifting heavy-tailed gradient stream
(:class:`DriftingGradient`: consecutive steps of one run, the paper's setting), the same gradient
for every method in a call. ``--profile`` prints Ok-Topk's per-phase median times per rank
(``PARATRAIN_COMPRESS_PROFILE``; the marks read a clock, no synchronisation is added). The last line of
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


class DriftingGradient:
    """Consecutive steps of one run, roughly: per-coordinate scales fixed and heavy-tailed
    (exp of a Gaussian), a mean that drifts slowly (AR(1), correlation ``rho`` from one call to the
    next) and fresh noise of ``noise`` times the mean's size each call."""

    def __init__(self, n: int, gen: torch.Generator, rho: float = 0.95, noise: float = 1.0) -> None:
        self.gen, self.rho, self.noise = gen, rho, noise
        self.scale = torch.exp(torch.randn(n, generator=gen))
        self.mean = torch.randn(n, generator=gen)

    def __call__(self) -> torch.Tensor:
        n = self.mean.numel()
        self.mean.mul_(self.rho).add_(torch.randn(n, generator=self.gen), alpha=(1 - self.rho ** 2) ** 0.5)
        return (self.mean + self.noise * torch.randn(n, generator=self.gen)).mul_(self.scale)


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
    phases: dict[float, dict[str, list[float]]] = {}
    exact_global: dict[float, int] = {}
    methods = [m for m in METHODS if m in args.methods]
    for density in args.densities:
        comps = {m: (None if m == "dense" else make_compressor(m, None, density, shapes)) for m in methods}
        stream = DriftingGradient(n, gen) if args.stream == "drift" else None
        for rep in range(args.warmup + args.reps):
            # every method reduces the same gradient of this call (one stream: consecutive steps)
            shared = stream() if stream is not None else None
            for m in methods:
                if m == "powersgd" and density != args.densities[0]:
                    continue  # its volume does not depend on the density: measured once
                g = shared.clone() if shared is not None else _gradient(n, gen)
                if rep == args.warmup and m == "oktopk":  # profile the timed calls only
                    comps[m].phases.times.clear()
                    comps[m].global_exact_calls = 0
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
        if "oktopk" in comps:
            phases[density] = comps["oktopk"].phases.times
            exact_global[density] = comps["oktopk"].global_exact_calls
    # the floor of any sparse method here: one pass adding the residual and one finding the entries
    # above a threshold (Ok-Topk's reused-threshold selection), no communication, all ranks at once
    from paratrain.runtime.compress.select import Scratch, accumulate_above, sampled_threshold

    scratch, residual = Scratch(), torch.zeros(n)
    for density in args.densities:
        for rep in range(args.warmup + args.reps):
            g = _gradient(n, gen)
            thr = sampled_threshold(g, max(1, math.ceil(n * density)))
            dist.barrier()
            start = time.perf_counter()
            accumulate_above(residual, g, thr, scratch)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            residual.zero_()
            if rep >= args.warmup:
                results.setdefault(("select only", density), []).append(float(elapsed))
                sent[("select only", density)] = 0
    every = [None] * world
    dist.all_gather_object(every, (phases, exact_global))
    if rank == 0:
        queue.put((results, sent, every))
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
    ap.add_argument("--stream", choices=("iid", "drift"), default="iid",
                    help="iid: each call a fresh heavy-tailed draw; drift: one slowly drifting gradient stream "
                         "(consecutive steps of one run), the same for every method")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--profile", action="store_true",
                    help="print Ok-Topk's per-phase median times per rank (PARATRAIN_COMPRESS_PROFILE)")
    args = ap.parse_args()
    if "dense" not in args.methods or "oktopk" not in args.methods:
        ap.error("--methods must include dense and oktopk (the ratios are against them)")
    if args.profile:
        from paratrain.runtime.compress.profile import ENV

        os.environ[ENV] = "1"  # inherited by the spawned ranks
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args.ranks, args, os.path.join(tmp, "rdzv"), queue), nprocs=args.ranks, join=True)
    results, sent, every = queue.get()
    n, p = args.elements, args.ranks
    print(f"one reduction of {n:,} fp32 elements on {p} gloo ranks (1 thread each), median of {args.reps} "
          f"after {args.warmup} warm-up call(s), {args.stream} gradients; torch {torch.__version__}, "
          f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}")
    dense = statistics.median(results[("dense", args.densities[0])])
    for density in args.densities:
        k = max(1, math.ceil(n * density))
        print(f"\ndensity {density:g} (k = {k:,}; Ok-Topk bound 6k(P-1)/P = {6 * k * (p - 1) / p:,.0f} elements)")
        print(f"{'method':<11} {'median s':>10} {'dense/this':>11} {'this/oktopk':>12} {'elements sent/rank':>19}")
        ok = statistics.median(results[("oktopk", density)])
        for m in (*[m for m in METHODS if m in args.methods], "select only"):
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
        if args.profile:
            names = list(every[0][0].get(density, {}))
            print(f"Ok-Topk phases, median ms per rank ({args.reps} timed calls; exact global threshold in "
                  f"{', '.join(str(e[1].get(density, 0)) for e in every)} of them on ranks 0..{p - 1}):")
            for name in names:
                meds = [1e3 * statistics.median(e[0][density][name]) if e[0][density].get(name) else 0.0
                        for e in every]
                print(f"  {name:<18} " + " ".join(f"{x:8.1f}" for x in meds))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
