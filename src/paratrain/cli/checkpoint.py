"""``paratrain checkpoint``: what a ``--checkpoint-dir`` holds, and full weights out of it.

Examples::

    paratrain checkpoint inspect ckpt/                 # every checkpoint: step, layout, size, integrity
    paratrain checkpoint inspect ckpt/ --json
    paratrain checkpoint export ckpt/ --to model.safetensors [--step 20]
    paratrain checkpoint export ckpt/ --hf hf-out/     # config.json + model.safetensors for transformers
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from paratrain.cli.options import JsonOpt, print_json
from paratrain.errors import ConfigError

__all__ = ["register", "inspect", "export"]

checkpoint_app = typer.Typer(help="Checkpoints of `paratrain train --checkpoint-dir`: inspect, export.",
                             no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(checkpoint_app, name="checkpoint")


def _existing_dir(directory: Path) -> None:
    if not directory.exists():
        raise ConfigError("DIR", f"{str(directory)!r} does not exist", "give a --checkpoint-dir of paratrain train")
    if not directory.is_dir():
        raise ConfigError("DIR", f"{str(directory)!r} is not a directory", "give a --checkpoint-dir of paratrain train")


def _layout(parallel: dict | None) -> str:
    if not parallel:
        return "-"
    return f"dp={parallel.get('dp')} tp={parallel.get('tp')} pp={parallel.get('pp')}"


@checkpoint_app.command("inspect", help="List the checkpoints in DIR: step, layout, size, integrity (checksums).")
def inspect(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="A --checkpoint-dir of paratrain train.")],
    json_out: JsonOpt = False,
) -> None:
    from paratrain.runtime.checkpoint.store import list_checkpoints

    _existing_dir(directory)
    found = list_checkpoints(directory)
    complete = [c for c in found if c.complete]
    doc = {"directory": str(directory), "checkpoints": [c.to_dict() for c in found],
           "newest_complete_step": complete[-1].step if complete else None}
    if json_out:
        print_json(doc)
        return
    if not found:
        typer.echo(f"{directory}: no paratrain checkpoint")
        return
    typer.echo(f"{'step':>8}  {'status':<10}  {'size':>10}  {'layout':<16}  {'model':<12}  problem")
    for c in found:
        d = c.to_dict()
        typer.echo(f"{c.step:>8}  {c.status:<10}  {c.size_bytes / 2**20:>7.2f} MiB  {_layout(d['parallel']):<16}  "
                   f"{d['model'] or '-':<12}  {c.problem or ''}".rstrip())
    newest = doc["newest_complete_step"]
    typer.echo(f"--resume would continue from step {newest}" if newest is not None
               else "--resume would fail: no complete checkpoint")


@checkpoint_app.command("export", help="Write the full model weights of a checkpoint as a safetensors file "
                        "(--to) or a Hugging Face model directory (--hf).")
def export(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="A --checkpoint-dir of paratrain train.")],
    to: Annotated[Path | None, typer.Option("--to", help="The .safetensors file to write (paratrain's names).")]
    = None,
    hf: Annotated[Path | None, typer.Option("--hf", help="A Hugging Face model directory to write (config.json + "
                  "model.safetensors) that transformers' from_pretrained loads.")] = None,
    step: Annotated[int | None, typer.Option("--step", help="Which checkpoint (default: newest complete).")] = None,
    json_out: JsonOpt = False,
) -> None:
    from paratrain.fileio import check_output_path
    from paratrain.runtime.checkpoint.export import choose, export_hf, export_safetensors

    if (to is None) == (hf is None):
        raise ConfigError("--to", "give exactly one of --to FILE and --hf DIR",
                          "use --to model.safetensors (paratrain's names) or --hf OUTDIR (Hugging Face)")
    if to is not None:
        check_output_path(to, "--to")
    _existing_dir(directory)
    flag, out = ("--to", to) if to is not None else ("--hf", hf)
    assert out is not None
    # An export inside DIR would overwrite a checkpoint's own files (--to DIR/step_N/__0_0.distcp)
    # or mix foreign files into the directory that --resume reads.
    if Path(os.path.realpath(out)).is_relative_to(os.path.realpath(directory)):
        raise ConfigError(flag, f"{str(out)!r} is inside the checkpoint directory {str(directory)!r}",
                          "write the export outside it")
    info = choose(directory, step)
    path, n, size = export_safetensors(info, to) if to is not None else export_hf(info, hf)  # type: ignore[arg-type]
    if json_out:
        print_json({"path": str(path), "step": info.step, "tensors": n, "size_bytes": size})
        return
    typer.echo(f"wrote {path}: {n} tensors, {size:,} bytes, from {info.path.name} (step {info.step})")
