"""Output of ``paratrain plan --sweep`` (CSV table, PNG plot) and of the shape advice."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from paratrain.cli.options import print_json

__all__ = ["run_sweep", "print_advice", "sweep_rows"]


def sweep_rows(points: list) -> list[dict[str, Any]]:
    rows = []
    for pt in points:
        row: dict[str, Any] = {pt.variable: pt.value}
        if pt.result is None:
            row["error"] = pt.error
        else:
            w = pt.result.winner
            cfg, m = w.config, w.metrics
            row.update(
                gpus=cfg.world_size,
                global_batch=cfg.global_batch,
                dp=cfg.dp,
                tp=cfg.tp,
                pp=cfg.pp,
                microbatch=cfg.microbatch,
                schedule=cfg.schedule.value,
                virtual_stages=cfg.virtual_stages,
                recompute=cfg.recompute.value,
                sequence_parallel=cfg.sequence_parallel,
                optimizer_sharding=cfg.optimizer_sharding,
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
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    from paratrain.plan.search import plan
    from paratrain.plan.sweep import parse_sweep, sweep

    variable, values = parse_sweep(text)
    points = sweep(model, cluster, global_batch, variable, values, plan, **kwargs)
    rows = sweep_rows(points)
    if table_out is not None:
        keys: list[str] = []
        for r in rows:
            keys += [k for k in r if k not in keys]
        with table_out.open("w", newline="") as fh:
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
