"""Output of ``paratrain plan --sweep`` (CSV table, PNG plot) and of the shape advice."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from paratrain.cli.options import as_flag_error, print_json, progress_bar
from paratrain.errors import ConfigError

if TYPE_CHECKING:
    from paratrain.plan.sweep import SweepPoint

__all__ = ["run_sweep", "print_advice", "sweep_rows"]


def sweep_rows(points: list[SweepPoint]) -> list[dict[str, Any]]:
    from paratrain.plan.report import LAYOUT_FIELDS, layout_row

    rows = []
    for pt in points:
        row: dict[str, Any] = {pt.variable: pt.value}
        if pt.result is None:
            row["error"] = str(as_flag_error(pt.error)) if pt.error is not None else None
        else:
            w = pt.result.winner
            cfg, m = w.config, w.metrics
            row.update(
                gpus=cfg.world_size,
                global_batch=cfg.global_batch,
                **layout_row(cfg, LAYOUT_FIELDS[:-1]),  # the mesh order is not a sweep column
                iteration_time_s=m.iteration_time_s,
                tokens_per_s=m.tokens_per_s,
                tflops_per_gpu=m.tflops_per_gpu,
                mfu=m.mfu,
                peak_memory_bytes=m.peak_memory_bytes,
                search_time_s=pt.result.search_time_s,
            )
        rows.append(row)
    return rows


def _label(row: dict[str, Any]) -> str:
    v = f" v{row['virtual_stages']}" if row.get("virtual_stages", 1) > 1 else ""
    return f"{row['dp']}×{row['tp']}×{row['pp']} mb{row['microbatch']} {row['schedule']}{v}"


def _plot(rows: list[dict[str, Any]], variable: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    xs = [r[variable] for r in ok]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(xs, [r["tokens_per_s"] for r in ok], "o-", color="tab:blue", label="tokens/s")
    ax.set_xlabel({"gpus": "GPUs", "batch": "global batch", "seq": "sequence length"}[variable])
    ax.set_ylabel("tokens/s", color="tab:blue")
    if variable in ("gpus", "batch"):
        ax.set_xscale("log", base=2)
    ax2 = ax.twinx()
    ax2.plot(xs, [100 * r["mfu"] for r in ok], "s--", color="tab:red", label="MFU")
    ax2.set_ylabel("MFU (%)", color="tab:red")
    ax2.set_ylim(0, 100)
    for r in ok:
        ax.annotate(
            _label(r),
            (r[variable], r["tokens_per_s"]),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=7,
            rotation=20,
        )
    ax.set_title(title)
    fig.tight_layout()
    from paratrain.fileio import atomic_write_png

    try:
        atomic_write_png(path, fig, "--plot")
    finally:
        plt.close(fig)


def _check_values(variable: str, values: list[int]) -> None:
    """Sweep values past the specs' hard limits are input errors, not rows of "no configuration"."""
    from paratrain.parallel.config import MAX_GLOBAL_BATCH
    from paratrain.spec.cluster import MAX_DEVICES
    from paratrain.spec.model import SHAPE_LIMITS

    limit, what = {
        "gpus": (MAX_DEVICES, "devices"),
        "batch": (MAX_GLOBAL_BATCH, "samples per iteration"),
        "seq": (SHAPE_LIMITS["seq"], "tokens per sequence"),
    }.get(variable, (None, ""))
    for v in values:
        if limit is not None and v > limit:
            raise ConfigError(
                "--sweep", f"{variable}={v:,} exceeds the limit of {limit:,} ({what})", f"use values up to {limit:,}"
            )


def run_sweep(
    model: Any,
    cluster: Any,
    global_batch: int,
    text: str,
    kwargs: dict[str, Any],
    *,
    plot: Path | None,
    table_out: Path | None,
    json_out: bool,
) -> None:
    from paratrain.fileio import atomic_writer, check_output_path
    from paratrain.plan.search import plan
    from paratrain.plan.sweep import parse_sweep, sweep

    variable, values = parse_sweep(text)
    _check_values(variable, values)
    if plot is not None:
        check_output_path(plot, "--plot")
    if table_out is not None:
        check_output_path(table_out, "--table")
    with progress_bar(f"sweeping {variable}", json_out) as tick:
        done = [0]

        def planner(*a: Any, **kw: Any) -> Any:
            try:
                return plan(*a, **kw)
            finally:
                done[0] += 1
                tick(done[0], len(values))

        points = sweep(model, cluster, global_batch, variable, values, planner, **kwargs)
    rows = sweep_rows(points)
    if table_out is not None:
        keys: list[str] = []
        for r in rows:
            keys += [k for k in r if k not in keys]
        with atomic_writer(table_out, "--table") as fh:
            w = csv.DictWriter(fh, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    if plot is not None:
        _plot(rows, variable, plot, f"{model.name} on {cluster.name}: best configuration per {variable}")
    if json_out:
        print_json({"variable": variable, "points": rows})
        return
    t = Table(title=f"Sweep over {variable}")
    for col in (variable, "best configuration", "recomp", "tokens/s", "TFLOP/s/GPU", "MFU", "iter s", "peak GiB"):
        t.add_column(col, justify="left" if col in ("best configuration", "recomp") else "right")
    for r in rows:
        if "error" in r:
            t.add_row(str(r[variable]), f"no configuration: {r['error']}", "", "", "", "", "", "")
            continue
        t.add_row(
            str(r[variable]),
            _label(r),
            r["recompute"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tflops_per_gpu']:.1f}",
            f"{100 * r['mfu']:.1f}%",
            f"{r['iteration_time_s']:.3f}",
            f"{r['peak_memory_bytes'] / 2**30:.1f}",
        )
    console = Console(width=160)
    console.print(t)
    for path in (table_out, plot):
        if path is not None:
            print(f"wrote {path}", file=sys.stdout)


def print_advice(console: Console, model: Any, rows: list[dict[str, Any]]) -> None:
    t = Table(title=f"Shapes near {model.name} ({model.param_count() / 1e9:.2f}B parameters, ±1%) predicted faster")
    for col in ("layers", "hidden", "heads", "head dim", "vocab", "ffn", "params", "speedup"):
        t.add_column(col, justify="right")
    t.add_row(
        str(model.layers),
        str(model.hidden),
        str(model.heads),
        str(model.head_dim),
        str(model.vocab),
        str(model.ffn_size),
        f"{model.param_count() / 1e9:.3f}B",
        "1.000 (given)",
    )
    for r in rows:
        t.add_row(
            str(r["layers"]),
            str(r["hidden"]),
            str(r["heads"]),
            str(r["hidden"] // r["heads"]),
            str(r["vocab"]),
            str(r["ffn"]),
            f"{r['params'] / 1e9:.3f}B",
            f"{r['speedup']:.3f}",
        )
    console.print(t)
    if not rows:
        console.print("no nearby shape is predicted faster")
