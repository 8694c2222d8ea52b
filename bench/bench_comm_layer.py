"""What the communication layer costs per call: torch directly vs the layer without a log (every
run without ``--comm-log``) vs the layer logging (``--comm-log``) vs the layer routing by a table.

One process, a gloo group of one rank (a HashStore, no network), so the figure is the layer's own
Python cost on top of torch's dispatch: an 8-byte all-reduce, synchronous and asynchronous.
Prints the median of ``--repeats`` timed batches of ``--calls`` calls, in microseconds per call;
the paths take turns batch by batch, so a loaded machine slows them alike.

    python bench/bench_comm_layer.py [--calls 2000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from paratrain.runtime.comm import layer as comm
from paratrain.runtime.comm.table import Choice, TuningTable


def _batch_us(fn: Callable[[], None], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.zeros((), dtype=torch.float64)
    table = TuningTable((), (Choice("all_reduce", 1, 0, None, "gloo"),), "gloo", 1)  # routes, to the run's own

    def sync_torch() -> None:
        dist.all_reduce(t)

    def async_torch() -> None:
        dist.all_reduce(t, async_op=True).wait()

    def sync_layer() -> None:
        comm.all_reduce(t, purpose="bench")

    def async_layer() -> None:
        comm.all_reduce(t, async_op=True, purpose="bench").wait()

    paths: list[tuple[str, comm.CommLayer | None, Callable[[], None]]] = [("torch directly", None, fn) for fn in
                                                                          (sync_torch, async_torch)]
    for label, layer in (("layer, no log", comm.CommLayer(rank=0)),
                         ("layer, --comm-log", comm.CommLayer(rank=0, log=True)),
                         ("layer, log + table", comm.CommLayer(rank=0, log=True, table=table))):
        paths += [(label, layer, sync_layer), (label, layer, async_layer)]
    times: list[list[float]] = [[] for _ in paths]
    for r in range(args.repeats + 1):  # round robin, so that the machine's load falls on every path alike
        for i, (_, layer, fn) in enumerate(paths):
            comm.use(layer)
            us = _batch_us(fn, args.calls)
            if r:  # the first round warms up
                times[i].append(us)
            if layer is not None:
                layer.take_rows()
    comm.use(None)
    med = [statistics.median(ts) for ts in times]
    rows = [(paths[i][0], med[i], med[i + 1]) for i in range(0, len(paths), 2)]
    base = rows[0]
    print(f"8-byte all-reduce, gloo, 1 rank, median of {args.repeats} x {args.calls} calls (us per call)")
    print(f"{'path':<22}{'sync':>10}{'added':>10}{'async+wait':>14}{'added':>10}")
    for label, s, a in rows:
        print(f"{label:<22}{s:>10.1f}{s - base[1]:>+10.1f}{a:>14.1f}{a - base[2]:>+10.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
