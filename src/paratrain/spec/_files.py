"""Reading spec documents from JSON, YAML or TOML files."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError

__all__ = ["load_document", "loading_preset_file"]

# Spec files being resolved, outermost first: a file whose ``preset`` leads back to itself.
_ACTIVE: list[Path] = []
_MAX_PRESET_DEPTH = 16


@contextlib.contextmanager
def loading_preset_file(path: str | Path, field: str) -> Iterator[None]:
    """Mark ``path`` as being resolved while the block runs; a ``preset`` chain that comes back to
    a file already being resolved (or nests absurdly deep) is a ConfigError, not a RecursionError."""
    p = Path(path).resolve()
    if p in _ACTIVE or len(_ACTIVE) >= _MAX_PRESET_DEPTH:
        chain = " -> ".join(str(x) for x in [*_ACTIVE[_ACTIVE.index(p) if p in _ACTIVE else 0 :], p])
        raise ConfigError(
            f"{field} preset", f"the preset chain loops: {chain}", "name a built-in preset or a file that does not"
            " lead back to itself"
        )
    _ACTIVE.append(p)
    try:
        yield
    finally:
        _ACTIVE.pop()


def load_document(path: str | Path, field: str) -> dict[str, Any]:
    """Load a mapping from a ``.json``, ``.yaml``/``.yml`` or ``.toml`` file.

    Raises:
        ConfigError: naming ``field`` (the flag that gave the path) when the file is missing,
            unreadable, malformed, or not a mapping at top level.
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(field, f"{str(p)!r} is a directory", "give a spec file or a preset name")
    if not p.is_file():
        raise ConfigError(field, f"file {str(p)!r} does not exist", "give an existing file or a preset name")
    suffix = p.suffix.lower()
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(field, f"cannot read {str(p)!r}: {e}", "check the file's permissions and encoding") from None
    try:
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as e:  # each parser raises its own error type
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(field, f"{str(p)!r} is malformed: {first}", "fix the syntax of the file") from None
    if not isinstance(data, dict):
        raise ConfigError(field, f"{str(p)!r} must hold a mapping at top level", "write the spec as key: value pairs")
    return data
