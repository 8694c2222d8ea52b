"""The tuned communication table against always-default choices, and the measured alpha-beta against
the cost model's prediction, on this machine in one run.

    .venv/bin/python bench/bench_comm.py                      # 2 processes, 1 KiB .. 4 MiB, ~1 min
    .venv/bin/python bench/bench_comm.py --nproc 4 --max-bytes 256MiB   # the full range

1. Tuning: ``paratrain comm tune``'s measurement (:func:`paratrain.runtime.comm.tune.tune`) over
   every operation, backend, group shape and size; the table chooses a backend per size band.
2. Held-out check: the same measurement again, and per (op, group, size) the time of the backend
   the *first* table chose against the time of the default backend (gloo), both from the second
   run. A choice that was noise comes out near 1.0 or above; one that holds, below. On a CPU the
   two backends are both gloo over loopback TCP (``gloo_1t``: a second gloo group with one worker
   thread instead of two), so the only difference is the worker threads: do not expect NCCL-vs-MPI
   gaps here.
3. The cost model: each measured time against ``collective_time`` on the ``cpu`` cluster preset
   (its link from ``paratrain calibrate`` when there is one, else the preset's default), and
   against the alpha-beta fitted per op to the first run (:func:`fit_alpha_beta_by_op`); mean
   absolute relative error per size band (< 16 KiB, 16 KiB - 1 MiB, >= 1 MiB).

Timings on a shared machine are noisy: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from paratrain.cost.collectives import collective_time
from paratrain.runtime.comm.table import TuningTable
from paratrain.runtime.comm.tune import fit_alpha_beta_by_op, message_sizes, tune
from paratrain.spec.cluster_presets import cluster_preset, cpu_links

_BANDS = (("< 16 KiB", 0, 2**14), ("16 KiB - 1 MiB", 2**14, 2**20), (">= 1 MiB", 2**20, 2**62))
_KIND = {"send_recv": "p2p"}


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB"


def _model_s(op: str, nbytes: int, p: int, cluster) -> float:
    kind = _KIND.get(op, op)
    ranks = (0, 1) if op == "send_recv" else tuple(range(p))
    return collective_time(kind, nbytes, ranks, cluster, "ring" if kind not in ("p2p", "all_to_all") else None).time_s


def _held_out(first: TuningTable, second: TuningTable) -> list[tuple[str, int, int, str, float, float]]:
    rows = []
    for m in second.measurements:
        if m.backend != second.default_backend:
            continue
        chosen = first.choose(m.op, m.bytes, m.group_size) or first.default_backend
        t = second.time_s(m.op, chosen, m.group_size, m.bytes)
        if t is not None:
            rows.append((m.op, m.group_size, m.bytes, chosen, m.time_s, t))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--max-bytes", type=int, default=2**22)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    sizes = message_sizes(2**10, args.max_bytes)
    load0 = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load0[0]:.1f} (1 min) before; {args.nproc} processes, "
          f"sizes {_size(sizes[0])} .. {_size(sizes[-1])}, {args.repeats} repeats (median)")
    first = tune(args.nproc, sizes=sizes, repeats=args.repeats)
    second = tune(args.nproc, sizes=sizes, repeats=args.repeats)
    print(f"tuning run {first.seconds:.0f} s, held-out run {second.seconds:.0f} s; backends "
          f"{', '.join(first.table.backends)}; skipped: {first.skipped}")

    print("\n1. tuned choice vs default (gloo), times from the held-out run")
    print(f"{'op':<15}{'ranks':>6}{'size':>9}{'chosen':>9}{'default':>11}{'tuned':>11}{'tuned/def':>10}")
    rows = _held_out(first.table, second.table)
    ratios = []
    for op, g, n, chosen, t_def, t_tuned in rows:
        r = t_tuned / t_def
        ratios.append(r)
        print(f"{op:<15}{g:>6}{_size(n):>9}{chosen:>9}{t_def * 1e6:>9.0f}us{t_tuned * 1e6:>9.0f}us{r:>10.2f}")
    differ = [r for (_, _, _, c, _, _), r in zip(rows, ratios, strict=True) if c != first.table.default_backend]
    print(f"geometric mean tuned/default: all {statistics.geometric_mean(ratios):.3f} over {len(ratios)} points; "
          f"where the table chose another backend {statistics.geometric_mean(differ) if differ else 1.0:.3f} "
          f"over {len(differ)} points")

    cluster = cluster_preset("cpu")
    link = cpu_links()
    how = "calibrated by paratrain calibrate" if link is not None else "the preset's default (not calibrated)"
    print(f"\n2. measured (tuning run, default backend) vs the cost model: cpu cluster link alpha "
          f"{cluster.intra_link.latency_s * 1e6:.1f} us, beta {cluster.intra_link.bandwidth_Bps / 1e9:.2f} GB/s "
          f"({how}); and vs alpha-beta fitted per op")
    fits = {(f.op, f.backend): f for f in fit_alpha_beta_by_op(first.table)}
    print("error |pred - meas| / meas per size band, as 'preset link / per-op fit'")
    print(f"{'op':<15}{'alpha us':>9}{'beta GB/s':>10}     " + "".join(f"{b:>16}" for b, _, _ in _BANDS))
    default = first.table.default_backend
    for (op, b), f in fits.items():
        if b != default:
            continue
        cells = []
        for _, lo, hi in _BANDS:
            pts = [m for m in first.table.measurements if (m.op, m.backend) == (op, b) and lo <= m.bytes < hi]
            if not pts:
                cells.append(f"{'-':>16}")
                continue
            e_model = statistics.fmean(abs(_model_s(op, m.bytes, m.group_size, cluster) - m.time_s) / m.time_s
                                       for m in pts)
            e_fit = statistics.fmean(abs(f.predict_s(m.bytes, m.group_size) - m.time_s) / m.time_s for m in pts)
            cells.append(f"{e_model:>8.0%} /{e_fit:>5.0%}")
        print(f"{op:<15}{f.latency_s * 1e6:>9.1f}{f.bandwidth_Bps / 1e9:>10.2f}     " + "".join(cells))
    load1 = os.getloadavg()
    print(f"\nload average {load1[0]:.1f} (1 min) after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
