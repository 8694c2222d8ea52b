"""Loss curves from ``paratrain train --metrics`` files: read the JSON lines, summarize, draw.

A run is one metrics file, labelled by its file name (without ``.jsonl``). Rows are keyed by
``step``; a step written twice (a resumed run) keeps its last row. Tokens are the row's ``tokens``
(cumulative), or for files without it the running sum of ``tokens_per_s × step_time_s``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.fileio import atomic_write_png, check_not_special, json_lines

__all__ = ["Curve", "read_curve", "summary", "plot_curves"]


@dataclass(frozen=True)
class Curve:
    label: str
    steps: list[int]
    loss: list[float]
    tokens: list[float] | None  # cumulative tokens at each step; None when the rows cannot tell
    eval_steps: list[int]
    eval_loss: list[float]
    eval_tokens: list[float] | None


def _rows(path: Path, field: str) -> list[dict[str, Any]]:
    check_not_special(path, field, "give a --metrics file written by paratrain train")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(field, f"cannot read {str(path)!r} ({getattr(e, 'strerror', None) or e})",
                          "give a --metrics file written by paratrain train") from None
    rows = json_lines(text, field, "give a --metrics file written by paratrain train (one JSON object per line)",
                      where=lambda n: f"{path}:{n}")
    for n, row in enumerate(rows, 1):
        if not isinstance(row.get("step"), int) or not isinstance(row.get("loss"), int | float):
            raise ConfigError(field, f"{path}: row {n} has no integer 'step' and number 'loss'",
                              "give a --metrics file written by paratrain train")
    if not rows:
        raise ConfigError(field, f"{path} holds no metrics rows", "give a --metrics file of a run that made steps")
    return rows


def read_curve(path: str | os.PathLike[str], field: str = "METRICS") -> Curve:
    p = Path(path)
    rows = _rows(p, field)
    rank = rows[0].get("rank", 0)
    by_step = {r["step"]: r for r in rows if r.get("rank", 0) == rank}  # a resumed step: the last row wins
    ordered = [by_step[s] for s in sorted(by_step)]
    tokens: list[float] | None = []
    total = 0.0
    for r in ordered:
        if isinstance(r.get("tokens"), int | float):
            total = float(r["tokens"])
        elif isinstance(r.get("tokens_per_s"), int | float) and isinstance(r.get("step_time_s"), int | float):
            total += round(r["tokens_per_s"] * r["step_time_s"])
        else:
            tokens = None
            break
        tokens.append(total)
    evals = [i for i, r in enumerate(ordered) if isinstance(r.get("eval_loss"), int | float)]
    return Curve(label=p.name.removesuffix(".jsonl"), steps=[r["step"] for r in ordered],
                 loss=[float(r["loss"]) for r in ordered], tokens=tokens,
                 eval_steps=[ordered[i]["step"] for i in evals],
                 eval_loss=[float(ordered[i]["eval_loss"]) for i in evals],
                 eval_tokens=None if tokens is None else [tokens[i] for i in evals])


def summary(curve: Curve) -> dict[str, Any]:
    """One run in numbers: steps, tokens, first/last/lowest loss, last/lowest eval loss."""
    finite = [x for x in curve.loss if math.isfinite(x)]
    return {"label": curve.label, "steps": len(curve.steps), "last_step": curve.steps[-1],
            "tokens": None if curve.tokens is None else int(curve.tokens[-1]),
            "first_loss": curve.loss[0], "last_loss": curve.loss[-1], "min_loss": min(finite) if finite else None,
            "evals": len(curve.eval_loss), "last_eval_loss": curve.eval_loss[-1] if curve.eval_loss else None,
            "min_eval_loss": min(curve.eval_loss) if curve.eval_loss else None}


def plot_curves(curves: list[Curve], out: str | os.PathLike[str], field: str = "--out") -> Path:
    """Training loss (lines) and eval loss (dashed, markers) against step and against tokens, one
    colour per run; the tokens panel is left out when a run's rows cannot tell tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_tokens = all(c.tokens is not None for c in curves)
    fig, axes = plt.subplots(1, 2 if by_tokens else 1, figsize=(12 if by_tokens else 6.5, 4.5), squeeze=False)
    for i, c in enumerate(curves):
        colour = f"C{i % 10}"
        panels: list[tuple[Any, list[float] | list[int], list[float] | list[int] | None]] = [
            (axes[0][0], c.steps, c.eval_steps)]
        if by_tokens:
            panels.append((axes[0][1], c.tokens or [], c.eval_tokens))
        for ax, x, ex in panels:
            ax.plot(x, c.loss, color=colour, lw=1.2, label=f"{c.label} train")
            if c.eval_loss and ex is not None:
                ax.plot(ex, c.eval_loss, color=colour, ls="--", marker="o", ms=4, label=f"{c.label} eval")
    axes[0][0].set_xlabel("step")
    if by_tokens:
        axes[0][1].set_xlabel("tokens")
    for ax in axes[0]:
        ax.set_ylabel("loss (cross-entropy, nats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("paratrain train: loss curves")
    fig.tight_layout()
    try:
        return atomic_write_png(out, fig, field)
    finally:
        plt.close(fig)
