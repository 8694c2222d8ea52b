"""The step loop's console output: a rich progress bar on rank 0 (loss, tokens/s, MFU) and one
log line per logged step, every line prefixed by the rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from .faults import rank_prefix

if TYPE_CHECKING:
    from .metrics import MetricsWriter
    from .train import Trainer

__all__ = ["run_loop", "format_step"]


def format_step(row: dict[str, Any], steps: int) -> str:
    return (f"step {row['step'] + 1}/{steps} loss {row['loss']:.4f} lr {row['lr']:.2e} "
            f"grad_norm {row['grad_norm']:.3f} tokens/s {row['tokens_per_s']:,.0f} mfu {100 * row['mfu']:.2f}%")


def run_loop(trainer: Trainer, writer: MetricsWriter) -> list[dict[str, Any]]:
    ctx, train = trainer.ctx, trainer.train
    prefix = rank_prefix(ctx.rank)
    console = Console(highlight=False, soft_wrap=True)
    if ctx.rank == 0:
        console.print(f"{prefix} {trainer.spec.name}: {trainer.spec.param_count():,} parameters, "
                      f"dp={trainer.config.dp} tp={trainer.config.tp} pp={trainer.config.pp} "
                      f"({train.dp_impl} data parallel) on {ctx.world_size}x {ctx.device.type} ({ctx.backend}), "
                      f"global batch {trainer.config.global_batch} = {trainer.config.num_microbatches} "
                      f"micro-batches of {trainer.config.microbatch} per replica, data {trainer.data.corpus.name} "
                      f"({trainer.data.corpus.size_bytes:,} bytes); MFU against {trainer.peak_flops / 1e12:.3g} "
                      f"TFLOP/s ({trainer.peak_device} preset)", markup=False)
    show_bar = ctx.rank == 0 and train.progress and console.is_terminal
    progress = Progress(TextColumn(escape(f"{prefix} train")), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s  MFU {task.fields[mfu]}"),
                        TimeRemainingColumn(), console=console, disable=not show_bar, transient=True)
    rows = []
    with progress:
        task = progress.add_task("train", total=train.steps, loss="-", tps="-", mfu="-")
        for step in range(train.steps):
            row = trainer.train_step(step)
            rows.append(row)
            writer.write({**row, "rank": ctx.rank})
            progress.update(task, advance=1, loss=f"{row['loss']:.4f}", tps=f"{row['tokens_per_s']:,.0f}",
                            mfu=f"{100 * row['mfu']:.2f}%")
            last = step == train.steps - 1
            if ctx.rank == 0 and (last or step % max(1, train.log_every) == 0):
                progress.console.print(f"{prefix} {format_step(row, train.steps)}", markup=False)
    return rows
