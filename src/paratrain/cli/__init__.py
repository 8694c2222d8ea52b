"""The ``paratrain`` command line.

Each command group lives in its own module with a ``register(app)`` function. Errors caused by
user input end the process with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import typer

from paratrain.errors import ConfigError

__all__ = ["app", "main"]

app = typer.Typer(
    name="paratrain",
    help="Plan, simulate and run large-scale distributed deep-learning training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root() -> None:
    """Plan, simulate and run large-scale distributed deep-learning training."""


# Command modules, in the order they appear in --help.
_COMMAND_MODULES = (
    "presets",
    "cost",
    "schedule",
    "simulate",
    "plan",
    "validate",
    "train",
    "plot",
    "checkpoint",
    "data",
    "compare",
    "calibrate",
    "comm",
    "demo",
    "cluster",
)

for _name in _COMMAND_MODULES:
    _mod = f"paratrain.cli.{_name}"
    if importlib.util.find_spec(_mod) is not None:
        importlib.import_module(_mod).register(app)


def fail(message: str) -> None:
    """Print one error line and exit 2."""
    print(f"paratrain: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _kinds(e: BaseException) -> set[str]:
    # typer vendors click in recent releases and imports it in older ones: match by class name
    # so both work.
    return {c.__name__ for c in type(e).__mro__}


def main(argv: list[str] | None = None) -> None:
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv, prog_name="paratrain", standalone_mode=False)
    except ConfigError as e:
        fail(str(e))
    except KeyboardInterrupt:
        print("paratrain: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:
        kinds = _kinds(e)
        if "NoArgsIsHelp" in kinds:
            ctx = getattr(e, "ctx", None)
            print(ctx.get_help() if ctx is not None else "")
            raise SystemExit(0) from None
        if "UsageError" in kinds:
            ctx = getattr(e, "ctx", None)
            hint = f" (fix: see `{ctx.command_path} --help`)" if ctx is not None else " (fix: see `paratrain --help`)"
            fail(f"{e.format_message()}{hint}".replace("\n", " "))  # type: ignore[attr-defined]
        if "Abort" in kinds:
            print("paratrain: aborted", file=sys.stderr)
            raise SystemExit(130) from None
        if "Exit" in kinds:
            raise SystemExit(getattr(e, "exit_code", 0)) from None
        raise
    if isinstance(rv, int) and rv:
        raise SystemExit(rv)
