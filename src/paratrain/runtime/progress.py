"""The step loop's console output: a rich progress bar on rank 0 (loss, tokens/s, MFU) and one
log line per logged step, every line prefixed by the rank."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .faults import rank_prefix

__all__ = ["StepConsole", "format_step"]


def _rate(row: dict[str, Any]) -> str:
    # tokens for the language models; samples (and no MFU) where a row has no tokens (the image task)
    if row.get("tokens_per_s") is None:
        return f"samples/s {row['samples_per_s']:,.1f}"
    return f"tokens/s {row['tokens_per_s']:,.0f}"


def _mfu(row: dict[str, Any]) -> str:
    return "-" if row.get("mfu") is None else f"{100 * row['mfu']:.2f}%"


def format_step(row: dict[str, Any], steps: int) -> str:
    return (f"step {row['step'] + 1}/{steps} loss {row['loss']:.4f} lr {row['lr']:.2e} "
            f"grad_norm {row['grad_norm']:.3f} {_rate(row)} mfu {_mfu(row)}{_eval(row)}")


def _eval(row: dict[str, Any]) -> str:
    # validation loss and perplexity on evaluation steps (runtime/eval.py)
    if row.get("eval_loss") is None:
        return ""
    return f" eval_loss {row['eval_loss']:.4f} eval_ppl {row['eval_ppl']:.2f}"


class StepConsole:
    """Rank 0 prints; other ranks stay quiet. Use as a context manager around the loop."""

    def __init__(self, rank: int, steps: int, *, log_every: int, progress_bar: bool) -> None:
        self.rank, self.steps, self.log_every = rank, steps, log_every
        self.prefix = rank_prefix(rank)
        self.console = Console(highlight=False, soft_wrap=True)
        show_bar = rank == 0 and progress_bar and self.console.is_terminal
        self.progress = Progress(
            TextColumn(escape(f"{self.prefix} train")), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[rate]}  MFU {task.fields[mfu]}"),
            TimeRemainingColumn(), console=self.console, disable=not show_bar, transient=True)
        self._task: Any = None

    def line(self, text: str) -> None:
        if self.rank == 0:
            self.progress.console.print(f"{self.prefix} {text}", markup=False)

    def step(self, row: dict[str, Any]) -> None:
        self.progress.update(self._task, advance=1, loss=f"{row['loss']:.4f}", rate=_rate(row), mfu=_mfu(row))
        step = row["step"]
        if step == self.steps - 1 or step % self.log_every == 0 or "eval_loss" in row:
            self.line(format_step(row, self.steps))

    def __enter__(self) -> StepConsole:
        self.progress.__enter__()
        self._task = self.progress.add_task("train", total=self.steps, loss="-", rate="-", mfu="-")
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.progress.__exit__(kind, exc, tb)
