"""``paratrain demo``: the main job on built-in defaults — plan, simulate, train.

1. plan GPT-3 175B on 1,024 A100-80GB (128 DGX A100 nodes), global batch 1536, with the A100's
   default calibration (fitted on published and measured runs, ``fitted-a100``) and flash attention;
2. simulate the winning configuration, writing its timeline (PNG) and a Perfetto trace;
3. train a tiny GPT for real on local processes (gloo on CPU, pipeline × data parallel) on this
   machine's own Python standard-library sources, and show the loss going down.

Each step runs the same command a user would type; the commands are printed first.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.rule import Rule

from paratrain.errors import ConfigError

__all__ = ["register", "demo"]

# The real run is a demonstration on a 2-layer model, not a training job.
_MAX_STEPS = 100_000


def register(app: typer.Typer) -> None:
    app.command("demo", help="Plan, simulate, then train for real on local processes (built-in defaults).")(demo)


def _run(console: Console, title: str, argv: list[str]) -> None:
    from paratrain.cli import main

    console.print(Rule(title))
    # A command is meant to be copied: never wrapped, whatever the width or the pipe.
    console.print(f"$ paratrain {shlex.join(argv)}", style="bold", soft_wrap=True, markup=False, highlight=False)
    try:
        main(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise


def _check_arguments(out: Path, steps: int, model: str, gpus: int, global_batch: int) -> None:
    """Every argument, before the first step: a typo must not cost the plan and the simulation."""
    from paratrain.fileio import check_output_path
    from paratrain.spec.cluster import resolve_cluster
    from paratrain.spec.model import resolve_model

    if steps < 1:
        raise ConfigError("--steps", f"must be at least 1, got {steps}", "e.g. --steps 40")
    if steps > _MAX_STEPS:
        raise ConfigError("--steps", f"{steps:,} exceeds the limit of {_MAX_STEPS:,}", f"use at most {_MAX_STEPS:,}")
    if gpus < 1:
        raise ConfigError("--gpus", f"must be positive, got {gpus}", "set --gpus to at least 1")
    if global_batch < 1:
        raise ConfigError("--global-batch", f"must be positive, got {global_batch}", "e.g. --global-batch 1536")
    resolve_model(model, "--model")
    resolve_cluster("dgx-a100", "--gpus", gpus=gpus)
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{str(out)!r} exists and is not a directory", "give a directory for the files")
    for name in ("plan.json", "timeline.png", "trace.json", "metrics.jsonl"):
        check_output_path(out / name, "--out")


def demo(
    out: Annotated[Path, typer.Option("--out", help="Directory for the plan, trace, timeline and metrics.")] = Path(
        "out/demo"
    ),
    steps: Annotated[int, typer.Option("--steps", help="Training steps of the real run.")] = 40,
    model: Annotated[str, typer.Option("--model", help="Model to plan and simulate.")] = "gpt3-175b",
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs to plan for (dgx-a100 nodes of 8).")] = 1024,
    global_batch: Annotated[int, typer.Option("--global-batch", help="Global batch to plan for.")] = 1536,
) -> None:
    _check_arguments(out, steps, model, gpus, global_batch)
    console = Console()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            "--out", f"cannot create {str(out)!r}: {e.strerror or e}", "choose a writable directory"
        ) from None
    plan_doc = out / "plan.json"
    _run(
        console,
        "1/3 plan: the fastest memory-feasible layout",
        [
            "plan",
            "--model",
            model,
            "--cluster",
            "dgx-a100",
            "--gpus",
            str(gpus),
            "--global-batch",
            str(global_batch),
            "--top",
            "5",
            "--output",
            str(plan_doc),
        ],
    )
    _run(
        console,
        "2/3 simulate the winner",
        [
            "simulate",
            "--config",
            str(plan_doc),
            "--plot",
            str(out / "timeline.png"),
            "--trace",
            str(out / "trace.json"),
        ],
    )
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    _run(
        console,
        "3/3 train a tiny GPT for real: 4 processes, pipeline 2 × data 2, 1F1B, gloo on CPU",
        [
            "train",
            "--model",
            "gpt-tiny",
            "--nproc",
            "4",
            "--pp",
            "2",
            "--dp",
            "2",
            "--schedule",
            "1f1b",
            "--global-batch",
            "16",
            "--microbatch",
            "2",
            "--steps",
            str(steps),
            "--lr",
            "3e-3",
            "--metrics",
            str(metrics),
            "--log-every",
            "10",
            "--no-progress",
        ],
    )
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if rows:
        first, last = rows[0]["loss"], rows[-1]["loss"]
        # Byte-level LM: a uniform guess costs ln(256) = 5.55 nats.
        console.print(Rule("result"))
        console.print(
            f"loss {first:.3f} → {last:.3f} over {len(rows)} steps "
            f"(uniform guess over 256 bytes: 5.545); files in {out}/"
        )
