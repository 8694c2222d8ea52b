"""The communication characterization of a training run, measured or simulated (OSU-style).

Anthony et al. ("Demystifying the Communication Characteristics for Distributed Transformer
Models", arXiv 2408.10197) log every collective and point-to-point call of a run and report its
volume and latency by operation, by parallelism, by message size, and its share of the step. This
module computes that report from calls, whichever produced them:

- a measured run: the rows ``paratrain train --comm-log`` writes (one JSON object per call and
  rank: ``op`` or ``kind``, ``bytes``, ``time_s``, ``rank``, ``axis``, ``step``), parsed by
  :func:`calls_from_rows`;
- a simulated layout: :func:`simulated_calls` turns the simulator's communication log
  (:class:`paratrain.sim.engine.CommRecord`) into calls. The simulator logs the tensor-parallel
  collectives of an action as one span without sizes; they are expanded here into the
  collectives the cost model counts per micro-batch (:func:`paratrain.cost.tensor_parallel.tp_parts`),
  each timed as the cost model times it.

Every figure is *per rank and per step*: the sum over the calls each rank took part in, averaged
over the ranks and the steps the calls cover. ``bytes`` is a call's buffer on its rank as
nccl-tests count it (all-gather: its output). The share of the step is communication time over
step time; time that overlaps compute (an asynchronous gradient all-reduce, an eager send: from
issue to completion) counts in full, so the share says how much communication there is, not how
much of it is exposed, and can pass 100 %. The blocking share counts only the calls the rank
waited on.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paratrain.errors import ConfigError
from paratrain.fileio import json_lines

if TYPE_CHECKING:
    from paratrain.parallel.config import ParallelConfig
    from paratrain.sim.report import SimResult
    from paratrain.spec.cluster import ClusterSpec
    from paratrain.spec.model import ModelSpec

__all__ = [
    "AXES",
    "CommCall",
    "CommProfile",
    "Stat",
    "calls_from_rows",
    "characterize",
    "parse_jsonl",
    "plot_profile",
    "simulated_calls",
    "step_time_from_metrics",
]

AXES = ("dp", "tp", "pp", "cp", "none")
# Axis of a row that does not name one, from the simulator's kinds.
_AXIS_OF_KIND = {"p2p": "pp", "tp": "tp", "all_reduce": "dp", "reduce_scatter+all_gather": "dp"}


@dataclass(frozen=True)
class CommCall:
    """One call on one rank (``count`` identical calls when the source aggregates them)."""

    op: str
    axis: str
    bytes: int | None
    time_s: float
    rank: int
    count: float = 1.0
    async_op: bool = False  # issued without waiting: its time runs beside compute


@dataclass(frozen=True)
class Stat:
    """Calls, bytes and seconds per rank per step."""

    calls: float
    bytes: float
    time_s: float

    def to_dict(self) -> dict[str, float]:
        return {"calls": self.calls, "bytes": self.bytes, "time_s": self.time_s}


@dataclass(frozen=True)
class CommProfile:
    """The report: see the module docstring."""

    source: str
    ranks: int
    steps: int
    step_time_s: float | None
    total: Stat
    by_op: dict[str, Stat]
    by_axis: dict[str, Stat]
    histogram: list[tuple[int | None, Stat]]  # (lower edge in bytes, a power of 2; None: size unknown)
    label: str = ""
    blocking: Stat = Stat(0.0, 0.0, 0.0)  # the calls the rank waited on (not asynchronous)
    fits_in_memory: bool | None = None  # simulated layouts: the peak rank's memory fits the device

    @property
    def comm_share(self) -> float | None:
        """Communication time over step time (may exceed 1 when calls overlap each other or compute)."""
        if not self.step_time_s:
            return None
        return self.total.time_s / self.step_time_s

    @property
    def blocking_share(self) -> float | None:
        """Time in blocking calls over step time: an upper bound of the exposed communication
        when asynchronous calls are hidden (their wait, if any, is not counted)."""
        if not self.step_time_s:
            return None
        return self.blocking.time_s / self.step_time_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "label": self.label,
            "ranks": self.ranks,
            "steps": self.steps,
            "step_time_s": self.step_time_s,
            "comm_time_s": self.total.time_s,
            "comm_bytes": self.total.bytes,
            "comm_calls": self.total.calls,
            "comm_share_of_step": self.comm_share,
            "blocking_time_s": self.blocking.time_s,
            "blocking_share_of_step": self.blocking_share,
            "fits_in_memory": self.fits_in_memory,
            "by_op": {k: v.to_dict() for k, v in self.by_op.items()},
            "by_axis": {k: v.to_dict() for k, v in self.by_axis.items()},
            "size_histogram": [{"min_bytes": lo, "max_bytes": None if lo is None else 2 * lo, **s.to_dict()}
                               for lo, s in self.histogram],
        }


def _bucket(nbytes: int | None) -> int | None:
    if nbytes is None:
        return None
    return 0 if nbytes < 1 else 1 << (int(nbytes).bit_length() - 1)


def characterize(
    calls: Iterable[CommCall], *, ranks: int, steps: int = 1, step_time_s: float | None = None,
    source: str = "measured", label: str = "",
) -> CommProfile:
    """Aggregate ``calls`` covering ``steps`` steps of ``ranks`` ranks into per-rank, per-step figures."""
    if ranks < 1 or steps < 1:
        raise ConfigError("comm log", f"needs at least one rank and one step, got {ranks} and {steps}",
                          "give a log with calls")
    scale = 1.0 / (ranks * steps)
    acc: dict[str, dict[Any, list[float]]] = {"op": {}, "axis": {}, "size": {}}
    total = [0.0, 0.0, 0.0]
    blocking = [0.0, 0.0, 0.0]
    for c in calls:
        b = 0.0 if c.bytes is None else c.bytes * c.count
        vals = (c.count, b, c.time_s * c.count)
        for key, k in (("op", c.op), ("axis", c.axis), ("size", _bucket(c.bytes))):
            cur = acc[key].setdefault(k, [0.0, 0.0, 0.0])
            for i in range(3):
                cur[i] += vals[i]
        for i in range(3):
            total[i] += vals[i]
            if not c.async_op:
                blocking[i] += vals[i]

    def stat(v: Sequence[float]) -> Stat:
        return Stat(v[0] * scale, v[1] * scale, v[2] * scale)

    by_op = {k: stat(v) for k, v in sorted(acc["op"].items(), key=lambda kv: -kv[1][2])}
    by_axis = {a: stat(acc["axis"][a]) for a in AXES if a in acc["axis"]}
    by_axis.update({a: stat(v) for a, v in acc["axis"].items() if a not in by_axis})
    sizes = sorted(k for k in acc["size"] if k is not None)
    hist = [(k, stat(acc["size"][k])) for k in sizes]
    if None in acc["size"]:
        hist.append((None, stat(acc["size"][None])))
    return CommProfile(source, ranks, steps, step_time_s, stat(total), by_op, by_axis, hist, label, stat(blocking))


# ---- measured runs --------------------------------------------------------------------------------


def parse_jsonl(text: str, field: str) -> list[dict[str, Any]]:
    """The JSON objects of a comm log's text (blank lines skipped); ConfigError naming the line."""
    return json_lines(text, field, "give the file paratrain train --comm-log wrote")


def _num(row: Mapping[str, Any], key: str, where: str, *, optional: bool = False) -> float | None:
    v = row.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ConfigError(where, f"{key!r} must be a number >= 0, got {v!r}",
                          "give the file paratrain train --comm-log wrote")
    return float(v)


def calls_from_rows(rows: Sequence[Mapping[str, Any]], field: str = "--comm-log") -> tuple[list[CommCall], int, int]:
    """``(calls, ranks, steps)`` from comm-log rows. Ranks: the distinct ``rank`` values (0 when a
    row has none: the simulator's rows); steps: the distinct ``step`` values (1 when absent)."""
    if not rows:
        raise ConfigError(field, "the communication log is empty", "run paratrain train with --comm-log FILE first")
    calls, ranks, steps = [], set(), set()
    for i, row in enumerate(rows, 1):
        where = f"{field} line {i}"
        op = row.get("op") or row.get("kind")
        if not isinstance(op, str) or not op:
            raise ConfigError(where, "has no 'op' or 'kind'", "give the file paratrain train --comm-log wrote")
        nb = _num(row, "bytes", where, optional=True)
        t = _num(row, "time_s", where)
        rank = row.get("rank", 0)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(where, f"'rank' must be a whole number >= 0, got {rank!r}",
                              "give the file paratrain train --comm-log wrote")
        axis = row.get("axis") or _AXIS_OF_KIND.get(str(row.get("kind")), "none")
        if not isinstance(axis, str):
            raise ConfigError(where, f"'axis' must be a string, got {axis!r}", "give the file paratrain train wrote")
        ranks.add(rank)
        steps.add(row.get("step"))
        assert t is not None
        calls.append(CommCall(op, axis, None if nb is None else int(nb), t, rank, async_op=row.get("async_op") is True))
    return calls, len(ranks), max(1, len(steps - {None}))


def step_time_from_metrics(rows: Sequence[Mapping[str, Any]], field: str = "--metrics") -> float:
    """The median ``step_time_s`` of ``paratrain train --metrics`` rows (robust to the first,
    warm-up step and to a step slowed by another job)."""
    ts = [r.get("step_time_s") for r in rows]
    good = [float(t) for t in ts if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0
            and math.isfinite(t)]
    if not good:
        raise ConfigError(field, "no 'step_time_s' in the metrics", "give the file paratrain train --metrics wrote")
    return statistics.median(good)


# ---- simulated layouts ----------------------------------------------------------------------------


def _tp_calls(model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, steps: int) -> list[CommCall]:
    """The tensor-parallel collectives of every chunk and micro-batch, counted and timed as the
    cost model does (:mod:`paratrain.cost.tensor_parallel`, :mod:`paratrain.cost.stage`)."""
    from paratrain.cost.collectives import collective_time
    from paratrain.cost.stage import partial_grad_accumulation, tp_ranks
    from paratrain.cost.tensor_parallel import measured_time, tp_parts
    from paratrain.parallel.config import Recompute

    if config.tp == 1:
        return []
    ranks = tp_ranks(config)
    parts = tp_parts(model, sequence_parallel=config.sequence_parallel, microbatch=config.microbatch,
                     dtype=config.dtype, runtime=cluster.tensor_parallel,
                     accumulated=partial_grad_accumulation(config))
    memo: dict[tuple[str, int], float] = {}

    def seconds(kind: str, nbytes: int) -> float:
        t = memo.get((kind, nbytes))
        if t is None:
            m = measured_time(cluster, kind, len(ranks), nbytes)
            t = memo[(kind, nbytes)] = m if m is not None else collective_time(kind, nbytes, ranks, cluster).time_s
        return t

    counts = config.layers_per_chunk(model.layers)
    layers = sum(counts)
    full = config.recompute is Recompute.FULL  # the backward runs the layers' forward again
    per_mb: dict[tuple[str, int], float] = {}
    for name, times in (("layer", layers), ("embedding", 1), ("head", 1)):
        part = parts[name]
        colls = list(part.forward) + list(part.backward) + (list(part.forward) if full and name == "layer" else [])
        for c in colls:
            per_mb[(c.kind, c.nbytes)] = per_mb.get((c.kind, c.nbytes), 0.0) + c.count * times
    m = config.num_microbatches * steps
    # spread over the pipeline's ranks: each holds its chunks' share (figures are per-rank means)
    return [CommCall(kind, "tp", nbytes, seconds(kind, nbytes), 0, n * m) for (kind, nbytes), n in per_mb.items()]


def simulated_calls(
    model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, result: SimResult, steps: int = 1,
    *, overlap: bool = True,
) -> list[CommCall]:
    """Calls of one pipeline (the ranks with dp and tp coordinate 0: every replica does the same)
    from a simulation recorded with its communication log, the tensor-parallel spans expanded.

    A transfer counts on both ends (a send and a receive); a gradient reduction on each member of
    the simulated pipeline; the gradient-norm all-reduce over the stages is axis ``none``.
    Sends are eager and, with ``overlap`` (the simulator's default ``overlap_grad_reduce``),
    gradient reductions run beside the backward: both asynchronous.
    """
    from paratrain.cost.collectives import collective_time

    pipeline = {config.rank_of(pp=q) for q in range(config.pp)}
    stage_group = tuple(config.rank_of(pp=q) for q in range(config.pp))
    calls: list[CommCall] = []
    for r in result.comm_log:
        if r.kind == "tp" or len(r.group) < 2:
            continue  # expanded below / a group of one moves nothing
        if r.kind == "p2p":
            src, dst = r.group
            calls += [CommCall("send", "pp", r.bytes, r.time_s, src, async_op=True),  # eager sends
                      CommCall("recv", "pp", r.bytes, r.time_s, dst)]
            continue
        members = [g for g in r.group if g in pipeline]
        if r.bytes == 4 and tuple(r.group) == stage_group:  # global-norm clipping's scalar
            calls += [CommCall("all_reduce", "none", 4, r.time_s, g) for g in members]
            continue
        if r.kind == "reduce_scatter+all_gather" and r.bytes:
            rs = collective_time("reduce_scatter", r.bytes, r.group, cluster).time_s
            ag = collective_time("all_gather", r.bytes, r.group, cluster).time_s
            part = rs / (rs + ag) if rs + ag > 0 else 0.5
            for g in members:
                calls += [CommCall("reduce_scatter", "dp", r.bytes, r.time_s * part, g, async_op=overlap),
                          CommCall("all_gather", "dp", r.bytes, r.time_s * (1 - part), g, async_op=overlap)]
            continue
        calls += [CommCall(r.kind, "dp", r.bytes, r.time_s, g, async_op=overlap) for g in members]
    return calls + _tp_calls(model, cluster, config, steps)


def simulate_profile(
    model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *, label: str = ""
) -> CommProfile:
    """Simulate ``config`` with its communication log and characterize it."""
    from paratrain.schedule.registry import generate
    from paratrain.sim.report import simulate_config

    res = simulate_config(model, cluster, config, record=True, duration_cv=0.0)
    steps = generate(config.schedule.value, stages=config.pp, microbatches=config.num_microbatches,
                     virtual_stages=config.virtual_stages).iterations
    calls = simulated_calls(model, cluster, config, res, steps)
    prof = characterize(calls, ranks=config.pp, steps=steps, step_time_s=res.iteration_time_s,
                        source="simulated", label=label or f"dp{config.dp} tp{config.tp} pp{config.pp}")
    peak = res.peak_memory_bytes
    fits = None if peak is None else peak <= cluster.device.usable_memory_bytes
    return dataclasses.replace(prof, fits_in_memory=fits)


# ---- picture --------------------------------------------------------------------------------------


def _size_label(lo: int | None) -> str:
    if lo is None:
        return "?"
    for unit, k in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if lo >= k:
            return f"{lo // k}{unit}"
    return f"{lo}"


def plot_profile(profiles: Sequence[CommProfile]) -> Any:
    """A figure: time by operation, bytes by axis and calls by message size, one bar group per
    profile. The caller writes it (:func:`paratrain.fileio.atomic_write_png`) and closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    n = len(profiles)
    width = 0.8 / max(n, 1)
    panels = (
        ("communication time by operation (ms per rank per step)",
         lambda p: {k: v.time_s * 1e3 for k, v in p.by_op.items()}),
        ("volume by parallelism axis (MiB per rank per step)",
         lambda p: {k: v.bytes / 2**20 for k, v in p.by_axis.items()}),
        ("calls by message size (per rank per step, log scale)",
         lambda p: {(-1 if k is None else k): v.calls for k, v in p.histogram}),
    )
    for n_panel, (ax, (title, get)) in enumerate(zip(axes, panels, strict=True)):
        keys: list[Any] = []
        for p in profiles:
            keys += [k for k in get(p) if k not in keys]
        if n_panel == 2:  # sizes in order, the unknown size last
            keys.sort(key=lambda k: (k < 0, k))
            ax.set_yscale("log")
        for i, p in enumerate(profiles):
            vals = get(p)
            ax.bar([j + i * width for j in range(len(keys))], [vals.get(k, 0.0) for k in keys], width,
                   label=p.label or p.source)
        ax.set_xticks([j + width * (n - 1) / 2 for j in range(len(keys))])
        ax.set_xticklabels([_size_label(None if k < 0 else k) if n_panel == 2 else k for k in keys],
                           rotation=45, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig
