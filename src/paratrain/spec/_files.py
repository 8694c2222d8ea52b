"""Reading spec documents from JSON, YAML or TOML files."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.fileio import check_not_special

__all__ = ["check_keys", "document_kind", "load_document", "loading_preset_file"]

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


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a key given twice is an error (the parser would keep the
    last one silently, and the first is usually the value meant)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a mapping key given twice (for the reason above)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader: Loader, node: Any, deep: bool = False) -> Any:
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return loader.construct_mapping(node, deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass


def load_document(path: str | Path, field: str) -> dict[str, Any]:
    """Load a mapping from a ``.json``, ``.yaml``/``.yml`` or ``.toml`` file.

    Raises:
        ConfigError: naming ``field`` (the flag that gave the path) when the file is missing,
            unreadable, malformed, or not a mapping at top level.
    """
    p = Path(path)
    if p.is_dir():
        raise ConfigError(field, f"{str(p)!r} is a directory", "give a spec file or a preset name")
    check_not_special(p, field, "give a spec file or a preset name")
    if not p.is_file():
        raise ConfigError(field, f"file {str(p)!r} does not exist", "give an existing file or a preset name")
    suffix = p.suffix.lower()
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(field, f"cannot read {str(p)!r}: {e}", "check the file's permissions and encoding") from None
    try:
        if suffix in (".yaml", ".yml"):
            data = _load_yaml(text)
        elif suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            data = tomllib.loads(text)
        else:
            data = json.loads(text, object_pairs_hook=_unique_keys)
    except Exception as e:  # each parser raises its own error type
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(field, f"{str(p)!r} is malformed: {first}", "fix the syntax of the file") from None
    if not isinstance(data, dict):
        raise ConfigError(field, f"{str(p)!r} must hold a mapping at top level", "write the spec as key: value pairs")
    return data


# Keys that give a document's kind away, most specific first: a wrong file passed to a flag is
# named for what it is instead of by its first unknown key.
_KIND_KEYS = (
    ("a Chrome trace", ("traceEvents",)),
    ("a pipeline schedule", ("actions",)),
    ("a run document (paratrain plan -o)", ("config", "parallel")),
    ("a cluster spec", ("devices_per_node", "intra_link", "inter_link")),
    ("a device spec", ("peak_fp32_flops", "peak_bf16_flops", "memory_bandwidth_Bps")),
    ("a model spec", ("hidden", "num_hidden_layers", "n_layer", "model_type")),
    ("a parallel config", ("dp", "tp", "pp", "microbatch")),
)


def document_kind(doc: Any) -> str | None:
    """What kind of paratrain document ``doc`` looks like ("a Chrome trace", "a model spec", ...),
    or None if no key gives it away."""
    if not isinstance(doc, dict):
        return None
    for kind, keys in _KIND_KEYS:
        if any(k in doc for k in keys):
            return kind
    return None


def check_keys(doc: dict[str, Any], cls: type, field: str, what: str, *, expected_kind: str,
               required: bool = True) -> None:
    """A ConfigError unless ``doc``'s keys are fields of the dataclass ``cls`` and (``required``)
    it has every field without a default. ``what`` names the document ("cluster"); when the
    document looks like another kind than ``expected_kind``, the message says so."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(doc) - known)
    if unknown:
        kind = document_kind(doc)
        seems = f"; the file looks like {kind}" if kind is not None and kind != expected_kind else ""
        raise ConfigError(f"{field} key {unknown[0]!r}", f"is not a {what} field{seems}",
                          f"use keys among: {', '.join(sorted(known))}")
    if required:
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in doc
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{field} key {missing[0]!r}", "is required",
                              f"add {missing[0]} (or a preset to start from)")
