"""Job throughputs per accelerator type: Gavel's measured table, and predictions from the cost model.

Gavel's ``simulation_throughputs.json`` maps ``worker type → "(job_type, scale_factor)" →
{"null": steps/s alone, "(other_type, sf)": [own steps/s, other's steps/s] when co-located}``. The
keys are Python tuple literals; they are read with :func:`ast.literal_eval` (literals only, never
code). ``gavel:NAME`` names a file shipped in ``paratrain/data/gavel``.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.data import DATA_DIR
from paratrain.errors import ConfigError
from paratrain.fileio import check_not_special

__all__ = ["GAVEL_DIR", "JobKey", "ThroughputTable", "read_throughputs", "resolve_data_path"]

GAVEL_DIR = DATA_DIR / "gavel"

JobKey = tuple[str, int]  # (job type, scale factor = GPUs the job uses)


def resolve_data_path(path: str | Path, field_name: str) -> Path:
    """``gavel:NAME`` → the shipped copy of Gavel's file NAME; anything else is a path."""
    text = str(path)
    if text.startswith("gavel:"):
        p = GAVEL_DIR / text[len("gavel:"):]
        if p.parent != GAVEL_DIR or not p.is_file():
            names = ", ".join(sorted(f"gavel:{q.name}" for q in GAVEL_DIR.iterdir() if q.suffix in (".json", ".trace")))
            raise ConfigError(field_name, f"no shipped file {text!r}", f"use one of {names}")
        return p
    p = Path(text)
    check_not_special(p, field_name, "give a data file or a shipped gavel:NAME")
    if not p.is_file():  # a directory exists but is no data file: say which
        raise ConfigError(field_name, f"{text!r} is a directory" if p.is_dir() else f"file {text!r} not found",
                          "check the path")
    return p


@dataclass
class ThroughputTable:
    """Steps/s of each (job type, scale factor) on each accelerator type, alone and co-located."""

    isolated: dict[JobKey, dict[str, float]] = field(default_factory=dict)
    colocated: dict[tuple[JobKey, JobKey], dict[str, tuple[float, float]]] = field(default_factory=dict)

    @property
    def worker_types(self) -> tuple[str, ...]:
        return tuple(sorted({w for row in self.isolated.values() for w in row}))

    def has(self, key: JobKey) -> bool:
        return key in self.isolated

    def get(self, key: JobKey, worker_type: str) -> float:
        """Steps/s of ``key`` alone on one ``worker_type`` (0 when the type cannot run it)."""
        return self.isolated.get(key, {}).get(worker_type, 0.0)

    def pair(self, key: JobKey, other: JobKey, worker_type: str) -> tuple[float, float]:
        """Steps/s of (``key``, ``other``) sharing ``worker_type``; (0, 0) when not measured."""
        return self.colocated.get((key, other), {}).get(worker_type, (0.0, 0.0))

    def merged(self, other: ThroughputTable) -> ThroughputTable:
        """This table with ``other``'s rows added (``other`` wins on a clash)."""
        iso = {k: dict(v) for k, v in self.isolated.items()}
        for k, v in other.isolated.items():
            iso.setdefault(k, {}).update(v)
        col = {k: dict(v) for k, v in self.colocated.items()}
        for k, v in other.colocated.items():
            col.setdefault(k, {}).update(v)
        return ThroughputTable(iso, col)

    def to_gavel_dict(self) -> dict[str, dict[str, dict[str, object]]]:
        out: dict[str, dict[str, dict[str, object]]] = {}
        for key, row in self.isolated.items():
            for w, thr in row.items():
                out.setdefault(w, {}).setdefault(str(key), {})["null"] = thr
        for (a, b), row in self.colocated.items():
            for w, (ta, tb) in row.items():
                out.setdefault(w, {}).setdefault(str(a), {})[str(b)] = [ta, tb]
        return out


def _key(text: str, where: str, field_name: str) -> JobKey:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if (not isinstance(value, tuple) or len(value) != 2 or not isinstance(value[0], str)
            or not isinstance(value[1], int) or isinstance(value[1], bool) or value[1] < 1):
        raise ConfigError(field_name, f"{where}: key {text!r} is not \"('job type', scale_factor)\"",
                          "use Gavel's simulation_throughputs.json format")
    return value[0], value[1]


def _rate(value: object, where: str, field_name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(field_name, f"{where}: throughput {value!r} is not a finite number ≥ 0",
                          "give steps per second")
    return float(value)


def table_from_gavel_dict(doc: object, field_name: str = "--throughputs") -> ThroughputTable:
    """Parse Gavel's throughput mapping (already loaded from JSON)."""
    if not isinstance(doc, Mapping) or not doc:
        raise ConfigError(field_name, "not a mapping of worker type to job throughputs",
                          "use Gavel's simulation_throughputs.json format")
    table = ThroughputTable()
    for worker, rows in doc.items():
        if not isinstance(rows, Mapping):
            raise ConfigError(field_name, f"worker type {worker!r}: not a mapping", "use Gavel's format")
        for key_text, entry in rows.items():
            key = _key(key_text, f"{worker}", field_name)
            if not isinstance(entry, Mapping) or "null" not in entry:
                raise ConfigError(field_name, f"{worker} {key_text}: no \"null\" (isolated) throughput",
                                  "use Gavel's format")
            table.isolated.setdefault(key, {})[worker] = _rate(entry["null"], f"{worker} {key_text}", field_name)
            for other_text, pair in entry.items():
                if other_text == "null":
                    continue
                other = _key(other_text, f"{worker} {key_text}", field_name)
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise ConfigError(field_name, f"{worker} {key_text} with {other_text}: not [self, other]",
                                      "use Gavel's format")
                where = f"{worker} {key_text} with {other_text}"
                table.colocated.setdefault((key, other), {})[worker] = (
                    _rate(pair[0], where, field_name), _rate(pair[1], where, field_name))
    return table


def read_throughputs(path: str | Path, field_name: str = "--throughputs") -> ThroughputTable:
    """Read a throughput file in Gavel's format (``gavel:simulation_throughputs.json`` for the shipped one)."""
    p = resolve_data_path(path, field_name)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(field_name, f"cannot read {str(p)!r}: {e}", "check the file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(field_name, f"{str(p)!r} is not JSON: {e.msg} at line {e.lineno}", "fix the file") from None
    return table_from_gavel_dict(doc, field_name)
