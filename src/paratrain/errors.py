"""User-facing errors.

Every error caused by user input (a config file, a CLI flag, a checkpoint) is a
:class:`ConfigError`. The CLI prints it as one line and exits with code 2; library users catch it
like any ``ValueError``.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any, TypeVar

E = TypeVar("E", bound=Enum)

__all__ = [
    "ConfigError",
    "ParatrainError",
    "parse_enum",
    "require_at_most",
    "require_bool",
    "require_finite",
    "require_positive",
    "require_positive_int",
]


class ParatrainError(Exception):
    """Base class of paratrain's own errors."""


class ConfigError(ParatrainError, ValueError):
    """Invalid input. ``field`` names the offending field or flag, ``fix`` says what to do.

    ``str(err)`` is a single line: ``"<field>: <problem> (fix: <fix>)"``.
    """

    def __init__(self, field: str, problem: str, fix: str | None = None) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        msg = f"{field}: {problem}"
        if fix:
            msg += f" (fix: {fix})"
        super().__init__(msg.replace("\n", " "))


def require_finite(field: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a finite number (not NaN, not ±inf, not a bool).

    JSON, YAML and the CLI's float flags all accept ``nan``/``inf``; every comparison with NaN is
    false, so an unchecked NaN passes ``x <= 0`` tests and poisons every result downstream.
    """
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok_type:
        raise ConfigError(field, f"must be a number, got {value!r}", f"set {field} to a number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(field, f"must be a finite number, got {value}", f"set {field} to a finite value")


def require_positive(field: str, value: object, *, allow_zero: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a finite positive (or non-negative) number."""
    require_finite(field, value)
    assert isinstance(value, (int, float))
    if value < 0 or (value == 0 and not allow_zero):
        bound = "non-negative" if allow_zero else "positive"
        raise ConfigError(field, f"must be {bound}, got {value}", f"set {field} to a {bound} value")


def require_positive_int(field: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int > 0."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(field, f"must be an integer, got {value!r}", f"set {field} to an integer")
    if value <= 0:
        raise ConfigError(field, f"must be positive, got {value}", f"set {field} to at least 1")


def require_bool(field: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is ``True`` or ``False`` (a file's ``"yes"`` or
    ``1`` would otherwise pass every truth test)."""
    if not isinstance(value, bool):
        raise ConfigError(field, f"must be true or false, got {value!r}", f"set {field} to true or false")


def require_at_most(field: str, value: int | float, limit: int | float, why: str) -> None:
    """Raise :class:`ConfigError` if ``value`` exceeds ``limit``; ``why`` says what the limit guards.

    Limits keep absurd input (``--gpus 1e9``) from hanging or exhausting memory; they sit far
    beyond any real job.
    """
    if value > limit:
        raise ConfigError(
            field, f"{value:,} exceeds the limit of {limit:,} ({why})", f"use a value of at most {limit:,}"
        )


def parse_enum(cls: type[E], field: str, value: Any) -> E:
    """``value`` as a member of ``cls`` (case-insensitive by value), or a ConfigError listing the choices."""
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        choices = ", ".join(str(m.value) for m in cls)
        raise ConfigError(field, f"unknown value {value!r}", f"use one of: {choices}") from None
