"""``paratrain plot``: loss curves of training runs from their ``--metrics`` files.

Examples::

    paratrain plot run.jsonl --out curves.png
    paratrain plot lr1e-3.jsonl lr3e-4.jsonl --out compare.png --json
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from paratrain.cli.options import JsonOpt, flag_errors, print_json

__all__ = ["register", "plot"]


def register(app: typer.Typer) -> None:
    app.command("plot", help="Loss and eval loss against step and tokens from train --metrics files, runs "
                "overlaid (PNG).")(flag_errors(plot))


def plot(
    metrics: Annotated[list[Path], typer.Argument(help="Metrics files of paratrain train --metrics (JSON lines); "
                                                  "each is one run, labelled by its file name.", metavar="METRICS",
                                                  show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="PNG file to write.")] = Path("curves.png"),
    json_out: JsonOpt = False,
) -> None:
    from paratrain.fileio import check_distinct_paths, check_output_path
    from paratrain.runtime.curves import plot_curves, read_curve, summary

    check_output_path(out, "--out")
    check_distinct_paths({"--out": out}, {"METRICS": list(metrics)})
    curves = [read_curve(m) for m in metrics]
    plot_curves(curves, out)
    runs = [summary(c) for c in curves]
    if json_out:
        print_json({"out": str(out), "runs": runs})
        return
    for r in runs:
        ev = "" if r["last_eval_loss"] is None else f", eval loss {r['last_eval_loss']:.4f} ({r['evals']} evals)"
        tokens = "" if r["tokens"] is None else f", {r['tokens']:,} tokens"
        typer.echo(f"{r['label']}: {r['steps']} steps{tokens}, loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}"
                   f"{ev}")
    typer.echo(f"wrote {out}")
