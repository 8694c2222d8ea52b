"""User-facing errors.

Every error caused by user input (a config file, a CLI flag, a checkpoint) is a
:class:`ConfigError`. The CLI prints it as one line and exits with code 2; library users catch it
like any ``ValueError``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

E = TypeVar("E", bound=Enum)

__all__ = ["ConfigError", "ParatrainError", "parse_enum", "require_positive", "require_positive_int"]


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


def require_positive(field: str, value: object, *, allow_zero: bool = False) -> None:
    """Raise :class:`ConfigError` unless ``value`` is a positive (or non-negative) number."""
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok_type:
        raise ConfigError(field, f"must be a number, got {value!r}", f"set {field} to a number")
    if value < 0 or (value == 0 and not allow_zero):
        bound = "non-negative" if allow_zero else "positive"
        raise ConfigError(field, f"must be {bound}, got {value}", f"set {field} to a {bound} value")


def require_positive_int(field: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int > 0."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(field, f"must be an integer, got {value!r}", f"set {field} to an integer")
    if value <= 0:
        raise ConfigError(field, f"must be positive, got {value}", f"set {field} to at least 1")


def parse_enum(cls: type[E], field: str, value: Any) -> E:
    """``value`` as a member of ``cls`` (case-insensitive by value), or a ConfigError listing the choices."""
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        choices = ", ".join(str(m.value) for m in cls)
        raise ConfigError(field, f"unknown value {value!r}", f"use one of: {choices}") from None
