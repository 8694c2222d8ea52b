"""The communication tuning table: which backend each (operation, group size, message size) uses.

MCR-DL (Anthony et al., IPDPS'23) picks a backend per call from measurements of every backend on
every operation and message size. ``paratrain comm tune`` measures them and writes this table;
``paratrain train --comm-table FILE`` reads it and the communication layer asks
:meth:`TuningTable.choose` for each call. Torch-free: the reader also serves the CLI's checks.

File format (JSON, ``"format": "paratrain-comm-table"``, ``"version": 1``)::

    {"format": "paratrain-comm-table", "version": 1,
     "world_size": 2, "default_backend": "gloo", "backends": ["gloo", "gloo_1t"],
     "measurements": [{"op": "all_reduce", "backend": "gloo", "group_size": 2,
                       "bytes": 1024, "time_s": 4.1e-05}, ...],
     "choices": [{"op": "all_reduce", "group_size": 2, "min_bytes": 0, "max_bytes": 1448,
                  "backend": "gloo_1t"}, ...],
     "machine": {...}}

``bytes`` is the buffer on each rank as nccl-tests and :mod:`paratrain.cost.collectives` count it:
the input of all-reduce, reduce-scatter, broadcast, all-to-all and a send, the output of an
all-gather. A choice covers ``min_bytes <= bytes < max_bytes`` (``max_bytes`` null: no upper end);
the bands of one (op, group size) are contiguous from 0 up. Between two measured sizes the band
edge is their geometric mean: the times of collectives grow about linearly, so on a log scale the
midpoint is where an even guess changes side. ``time_s`` is the median over the repeats. Another
backend replaces the default only where it is faster by more than :data:`SWITCH_MARGIN`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.fileio import check_not_special

__all__ = [
    "BACKENDS",
    "FORMAT",
    "OPS",
    "SWITCH_MARGIN",
    "VERSION",
    "Choice",
    "Measurement",
    "TuningTable",
    "canonical_op",
    "check_backend",
    "choices_from_measurements",
    "load_table",
    "write_table",
]

FORMAT = "paratrain-comm-table"
VERSION = 1

# Backend name -> (torch.distributed backend, gloo worker threads or None for torch's default, what
# it is). "gloo_1t" is a second gloo process group over the same ranks with one worker thread
# instead of torch's two: on a CPU-only machine it is the one other setting torch exposes for gloo
# (ProcessGroupGloo options), so mixing it with "gloo" exercises two groups with different tuning.
BACKENDS: dict[str, tuple[str, int | None, str]] = {
    "gloo": ("gloo", None, "torch's gloo process group, default options"),
    "gloo_1t": ("gloo", 1, "a second gloo process group with one worker thread"),
    "nccl": ("nccl", None, "NCCL (CUDA tensors only)"),
    "mpi": ("mpi", None, "MPI (when torch was built with it)"),
}

# The operations the tuner measures; send and recv are timed as one ping from rank 0 to rank 1.
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv")
_ALIASES = {"send": "send_recv", "recv": "send_recv", "isend": "send_recv", "irecv": "send_recv",
            "p2p": "send_recv", "reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather",
            "all_to_all_single": "all_to_all"}


def canonical_op(op: str) -> str | None:
    """The table's name of a communication call (``send`` -> ``send_recv``), None if not tuned."""
    op = _ALIASES.get(op, op)
    return op if op in OPS else None


def check_backend(name: str, field: str) -> str:
    """``name`` if it is a known backend; ConfigError naming ``field`` otherwise."""
    if name not in BACKENDS:
        raise ConfigError(field, f"unknown backend {name!r}", f"use one of: {', '.join(BACKENDS)}")
    return name


@dataclass(frozen=True)
class Measurement:
    """Median time of one call of ``op`` with ``bytes`` per rank on ``backend`` over ``group_size`` ranks."""

    op: str
    backend: str
    group_size: int
    bytes: int
    time_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "backend": self.backend, "group_size": self.group_size, "bytes": self.bytes,
                "time_s": self.time_s}


@dataclass(frozen=True)
class Choice:
    """``backend`` for ``op`` over ``group_size`` ranks when ``min_bytes <= bytes < max_bytes``."""

    op: str
    group_size: int
    min_bytes: int
    max_bytes: int | None  # None: no upper end
    backend: str

    def covers(self, nbytes: int) -> bool:
        return self.min_bytes <= nbytes and (self.max_bytes is None or nbytes < self.max_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "group_size": self.group_size, "min_bytes": self.min_bytes,
                "max_bytes": self.max_bytes, "backend": self.backend}


@dataclass(frozen=True)
class TuningTable:
    """Measured times and the backend chosen per (op, group size, size band)."""

    measurements: tuple[Measurement, ...]
    choices: tuple[Choice, ...]
    default_backend: str = "gloo"
    world_size: int = 0
    machine: Mapping[str, Any] = field(default_factory=dict)
    _index: dict[tuple[str, int], tuple[Choice, ...]] = field(default_factory=dict, init=False, repr=False,
                                                                compare=False)

    def __post_init__(self) -> None:
        index: dict[tuple[str, int], list[Choice]] = {}
        for c in self.choices:
            index.setdefault((c.op, c.group_size), []).append(c)
        self._index.update({k: tuple(sorted(v, key=lambda c: c.min_bytes)) for k, v in index.items()})

    @property
    def backends(self) -> tuple[str, ...]:
        """Every backend the table names, default first."""
        names = [self.default_backend] + [m.backend for m in self.measurements] + [c.backend for c in self.choices]
        return tuple(dict.fromkeys(names))

    def choose(self, op: str, nbytes: int, group_size: int) -> str | None:
        """The backend for one call, or None to use the default (an op or group the table lacks).

        A group size the table did not measure takes the nearest measured one on a log scale
        (ties: the smaller), as the time of a collective grows with ``log p`` or ``(p-1)/p``.
        """
        name = canonical_op(op)
        if name is None:
            return None
        sizes = sorted({g for (o, g) in self._index if o == name})
        if not sizes:
            return None
        g = min(sizes, key=lambda s: (abs(math.log(s / max(group_size, 1))), s))
        bands = self._index[(name, g)]
        for c in bands:
            if c.covers(nbytes):
                return c.backend
        return bands[-1].backend if nbytes >= bands[-1].min_bytes else bands[0].backend

    def time_s(self, op: str, backend: str, group_size: int, nbytes: int) -> float | None:
        """The measured median, or None if that point was not measured."""
        for m in self.measurements:
            if (m.op, m.backend, m.group_size, m.bytes) == (op, backend, group_size, nbytes):
                return m.time_s
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "world_size": self.world_size,
            "default_backend": self.default_backend,
            "backends": list(self.backends),
            "measurements": [m.to_dict() for m in self.measurements],
            "choices": [c.to_dict() for c in self.choices],
            "machine": dict(self.machine),
        }


# Another backend replaces the default only if it is this much faster: medians of a few repeats on
# a shared machine differ by more than that between two runs of the *same* backend, and a switch
# that noise made costs as much as one it did not.
SWITCH_MARGIN = 0.10


def choices_from_measurements(
    measurements: Iterable[Measurement], default: str = "gloo", margin: float = SWITCH_MARGIN
) -> tuple[Choice, ...]:
    """Per (op, group size): the fastest backend at each measured size, as contiguous bands.

    ``default`` keeps a size unless another backend is faster by more than ``margin`` (a
    fraction of the default's time). Band edges lie at the geometric mean of neighbouring
    measured sizes; neighbouring bands with the same backend merge. Ties go to the backend listed
    first in :data:`BACKENDS`.
    """
    rank = {name: i for i, name in enumerate(BACKENDS)}
    best: dict[tuple[str, int], dict[int, tuple[float, int, str]]] = {}
    for m in measurements:
        cur = best.setdefault((m.op, m.group_size), {})
        # the default competes with its time shortened by the margin
        t = m.time_s * (1 - margin) if m.backend == default else m.time_s
        cand = (t, rank.get(m.backend, len(rank)), m.backend)
        if m.bytes not in cur or cand < cur[m.bytes]:
            cur[m.bytes] = cand
    out: list[Choice] = []
    for (op, g), by_size in sorted(best.items()):
        sizes = sorted(by_size)
        bands: list[Choice] = []
        for i, s in enumerate(sizes):
            lo = 0 if i == 0 else math.isqrt(sizes[i - 1] * s) + 1  # integer geometric mean, rounded up
            hi = None if i == len(sizes) - 1 else math.isqrt(s * sizes[i + 1]) + 1
            backend = by_size[s][2]
            if bands and bands[-1].backend == backend:
                bands[-1] = Choice(op, g, bands[-1].min_bytes, hi, backend)
            else:
                bands.append(Choice(op, g, lo, hi, backend))
        out += bands
    return tuple(out)


def _field(doc: Mapping[str, Any], key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if key not in doc:
        raise ConfigError(where, f"missing key {key!r}", "regenerate the table with paratrain comm tune")
    v = doc[key]
    if isinstance(v, bool) or not isinstance(v, kind):
        raise ConfigError(f"{where}.{key}", f"has the wrong type ({type(v).__name__})",
                          "regenerate the table with paratrain comm tune")
    return v


def _count(doc: Mapping[str, Any], key: str, where: str, *, minimum: int) -> int:
    v = _field(doc, key, where, int)
    if v < minimum:
        raise ConfigError(f"{where}.{key}", f"must be >= {minimum}, got {v}", "regenerate the table")
    return int(v)


def _op(doc: Mapping[str, Any], where: str) -> str:
    op = _field(doc, "op", where, str)
    if op not in OPS:
        raise ConfigError(f"{where}.op", f"unknown operation {op!r}", f"use one of: {', '.join(OPS)}")
    return str(op)


def table_from_dict(doc: Any, field_name: str = "--comm-table") -> TuningTable:
    """Validate a parsed table document; ConfigError naming the first bad entry."""
    if not isinstance(doc, dict):
        raise ConfigError(field_name, "a tuning table must be a JSON object", "give a file from paratrain comm tune")
    if doc.get("format") != FORMAT:
        raise ConfigError(field_name, f"not a tuning table (format {doc.get('format')!r}, expected {FORMAT!r})",
                          "give a file from paratrain comm tune")
    if doc.get("version") != VERSION:
        raise ConfigError(field_name, f"tuning table version {doc.get('version')!r} is not supported "
                          f"(this paratrain reads version {VERSION})", "regenerate it with paratrain comm tune")
    default = check_backend(_field(doc, "default_backend", field_name, str), f"{field_name}.default_backend")
    world = _count(doc, "world_size", field_name, minimum=1)
    ms = []
    for i, m in enumerate(_field(doc, "measurements", field_name, list)):
        where = f"{field_name}.measurements[{i}]"
        if not isinstance(m, dict):
            raise ConfigError(where, "must be an object", "regenerate the table")
        t = _field(m, "time_s", where, (int, float))
        if not (math.isfinite(t) and t >= 0):
            raise ConfigError(f"{where}.time_s", f"must be a finite time >= 0, got {t}", "regenerate the table")
        ms.append(Measurement(_op(m, where), check_backend(_field(m, "backend", where, str), f"{where}.backend"),
                              _count(m, "group_size", where, minimum=1), _count(m, "bytes", where, minimum=0),
                              float(t)))
    cs = []
    for i, c in enumerate(_field(doc, "choices", field_name, list)):
        where = f"{field_name}.choices[{i}]"
        if not isinstance(c, dict):
            raise ConfigError(where, "must be an object", "regenerate the table")
        hi = c.get("max_bytes")
        if hi is not None and (isinstance(hi, bool) or not isinstance(hi, int)):
            raise ConfigError(f"{where}.max_bytes", "must be a whole number of bytes or null", "regenerate the table")
        lo = _count(c, "min_bytes", where, minimum=0)
        if hi is not None and hi <= lo:
            raise ConfigError(where, f"empty band: min_bytes {lo} >= max_bytes {hi}", "regenerate the table")
        cs.append(Choice(_op(c, where), _count(c, "group_size", where, minimum=1), lo, hi,
                         check_backend(_field(c, "backend", where, str), f"{where}.backend")))
    _check_bands(cs, field_name)
    machine = doc.get("machine", {})
    return TuningTable(tuple(ms), tuple(cs), default, world, machine if isinstance(machine, dict) else {})


def _check_bands(choices: Sequence[Choice], field_name: str) -> None:
    """The bands of each (op, group size) start at 0, follow each other without gap or overlap
    and only the last is open-ended: so every size has exactly one backend."""
    groups: dict[tuple[str, int], list[Choice]] = {}
    for c in choices:
        groups.setdefault((c.op, c.group_size), []).append(c)
    for (op, g), bands in groups.items():
        bands.sort(key=lambda c: c.min_bytes)
        edge: int | None = 0
        for c in bands:
            if edge is None or c.min_bytes != edge:
                raise ConfigError(f"{field_name}.choices", f"the size bands of {op} over {g} ranks overlap or "
                                  f"leave a gap at {c.min_bytes} bytes", "regenerate the table")
            edge = c.max_bytes


def load_table(path: str | Path, field_name: str = "--comm-table") -> TuningTable:
    """Read a tuning table written by ``paratrain comm tune``; ConfigError on a missing or malformed file."""
    p = Path(path)
    check_not_special(p, field_name, "give a table from paratrain comm tune")
    if not p.is_file():  # a directory exists but is no table: say which
        problem = f"{str(p)!r} is a directory" if p.is_dir() else f"file {str(p)!r} does not exist"
        raise ConfigError(field_name, problem, "give a table from paratrain comm tune")
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(field_name, f"{str(p)!r} is not a readable JSON table: {first}",
                          "give a table from paratrain comm tune") from None
    return table_from_dict(doc, field_name)


def write_table(path: str | Path, table: TuningTable, field_name: str = "--output") -> Path:
    """Write ``table`` atomically (a crash leaves the old file or none, never half a table)."""
    from paratrain.fileio import atomic_write_text

    return atomic_write_text(path, json.dumps(table.to_dict(), indent=1) + "\n", field_name)
