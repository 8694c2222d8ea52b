"""``paratrain train --comm-log FILE``: every rank's comm-log rows in one JSON-lines file.

At the end of the run rank 0 gathers the rows of all ranks (one ``gather_object`` on the default
group, itself not in the log) and writes them sorted by start time, then rank, atomically: a crash
leaves the previous file or none. One row per call and rank (:class:`~.layer.CommCall`): a
collective appears once per member, a transfer twice (its ``send`` row on the source, its ``recv``
row on the destination); the simulator logs a transfer once, on the receiver, so compare its
``p2p`` rows with the measured rows whose ``op`` is ``recv``.
"""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from paratrain.fileio import atomic_writer

from .layer import CommCall, CommLayer

__all__ = ["gather_rows", "write_comm_log", "read_comm_log"]


def gather_rows(layer: CommLayer) -> list[CommCall] | None:
    """Every rank's rows on rank 0 (sorted by start time, then rank); ``None`` on the other ranks.
    A collective over the default group: every rank calls it."""
    layer.settle()
    mine = layer.take_rows()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return sorted(mine, key=lambda r: (r.start_s, r.rank))
    rank = dist.get_rank()
    gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    if rank != 0:
        return None
    return sorted((r for rows in gathered for r in rows), key=lambda r: (r.start_s, r.rank))


def write_comm_log(path: str, layer: CommLayer, field: str = "--comm-log") -> int | None:
    """Gather the rows (a collective) and write them on rank 0; returns the row count there."""
    rows = gather_rows(layer)
    if rows is None:
        return None
    with atomic_writer(path, field) as fh:
        for r in rows:
            fh.write(json.dumps(r.to_dict()) + "\n")
    return len(rows)


def read_comm_log(path: str) -> list[dict[str, Any]]:
    """The rows of a comm log, as dicts (tests and scripts; ``paratrain comm characterize`` has its
    own checked reader)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
