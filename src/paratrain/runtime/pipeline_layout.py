"""A pipeline run's layout: the model cut into the chunks a pipeline rank holds
(:func:`cut_model`; a second model copy for Chimera's replica-1 chunks) and the process groups
among the ranks holding copies of the same parameters (:func:`make_groups`): a chunk's ``R``
group, a stage's group, a tied parameter's pipeline ranks, and Chimera's copies of a chunk.
Used by :class:`~paratrain.runtime.pipeline.PipelineExecutor`."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import nn

from paratrain.parallel.config import ParallelConfig
from paratrain.schedule.compiled import hosts_of
from paratrain.schedule.ir import Schedule

from .mesh import RuntimeContext
from .models import TransformerLM

__all__ = ["ChunkLayout", "PipelineGroups", "cut_model", "make_groups"]


# ----- the model cut into this rank's chunks -------------------------------------------------------

@dataclass
class ChunkLayout:
    """The chunks a pipeline rank holds and how their parameters map to the full model's."""

    held: list[tuple[int, int]]  # (chunk, replica), in the schedule's order
    modules: list[nn.Module]  # one per held chunk; tensor parallelism is applied to these in place of them
    canonical: dict[tuple[int, int], dict[str, str]]  # (chunk, replica) -> local name -> full-model name
    chunks_of_name: dict[str, set[int]]  # full-model name -> chunks (replica 0) holding it
    tie_owner: dict[str, int]  # full-model name -> pipeline rank whose copy counts in the global norm


def cut_model(model: TransformerLM, schedule: Schedule, config: ParallelConfig, pp_rank: int) -> ChunkLayout:
    """The chunks of ``model`` (cut by the config's partition) that ``schedule`` places on ``pp_rank``."""
    sizes = config.layers_per_chunk(model.spec.layers)
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    models = [model] + [copy.deepcopy(model) for _ in range(schedule.num_replicas - 1)]
    names = [{id(p): n for n, p in m.named_parameters()} for m in models]
    # which chunks (of replica 0) hold each parameter, to find those two pipeline ranks share
    chunks_of_name: dict[str, set[int]] = {}
    for c, start in enumerate(starts):
        for _, p in model.chunk(start, start + sizes[c]).named_parameters(remove_duplicate=False):
            chunks_of_name.setdefault(names[0][id(p)], set()).add(c)
    held = list(schedule.chunks_of(pp_rank))
    modules, canonical = [], {}
    for c, rep in held:
        ch = models[rep].chunk(starts[c], starts[c] + sizes[c])
        canonical[(c, rep)] = {n: names[rep][id(p)] for n, p in ch.named_parameters(remove_duplicate=False)}
        modules.append(ch)
    tie_owner = {n: schedule.placement[0][min(cs)] for n, cs in chunks_of_name.items()}
    return ChunkLayout(held, modules, canonical, chunks_of_name, tie_owner)


@dataclass
class PipelineGroups:
    """This rank's process groups of a pipeline run (``None``: a group of one rank)."""

    reduce: dict[int, dist.ProcessGroup | None]  # chunk -> the ranks holding a copy of it (R)
    stage: dist.ProcessGroup | None  # the ranks of this pipeline rank's stage (asynchronous clipping)
    tie: dict[str, dist.ProcessGroup | None]  # shared parameter -> the pipeline ranks holding it
    # Chimera under FSDP2: chunk -> the pipeline ranks holding a copy of it at this rank's (dp, cp,
    # tp), whose dp-reduced shards are summed (empty without replicas)
    replica: dict[int, dist.ProcessGroup | None] = field(default_factory=dict)


def make_groups(config: ParallelConfig, schedule: Schedule, layout: ChunkLayout, ctx: RuntimeContext) -> PipelineGroups:
    """Create the groups of :class:`PipelineGroups` (a collective: every rank, same order)."""
    pp_rank, dp_rank, cp_rank, tp_rank = ctx.pp_rank, ctx.dp_rank, ctx.cp_rank, ctx.tp_rank
    # (dp, cp) coordinates: the ranks that hold the same parameters
    replicas = [(d, k) for d in range(config.dp) for k in range(config.cp)]
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def group_of(ranks: list[int]) -> dist.ProcessGroup | None:
        key = tuple(sorted(ranks))
        if len(key) == 1:
            return None
        if key not in made:
            made[key] = dist.new_group(list(key))
        return made[key]

    reduce: dict[int, dist.ProcessGroup | None] = {}
    for c in range(schedule.num_chunks):
        hosts = hosts_of(schedule, c)
        for t in range(config.tp):
            g = group_of([config.rank_of(pp=h, dp=d, cp=k, tp=t) for h in hosts for d, k in replicas])
            if t == tp_rank and pp_rank in hosts:
                reduce[c] = g
    stage = None
    for h in range(config.pp):
        g = group_of([config.rank_of(pp=h, dp=d, cp=k, tp=t) for d, k in replicas for t in range(config.tp)])
        if h == pp_rank:
            stage = g
    # tied parameters across pipeline ranks: one group per (name, dp, cp, tp), made on every rank
    tie: dict[str, dist.ProcessGroup | None] = {}
    for name, cs in sorted(layout.chunks_of_name.items()):
        hosts = sorted({schedule.placement[0][c] for c in cs})
        if len(hosts) < 2:
            continue
        for d, k in replicas:
            for t in range(config.tp):
                g = group_of([config.rank_of(pp=h, dp=d, cp=k, tp=t) for h in hosts])
                if (d, k, t) == (dp_rank, cp_rank, tp_rank) and pp_rank in hosts:
                    tie[name] = g
    replica: dict[int, dist.ProcessGroup | None] = {}
    if schedule.num_replicas > 1:  # one group per (chunk, dp, cp, tp), made on every rank
        for c in range(schedule.num_chunks):
            hosts = hosts_of(schedule, c)
            for d, k in replicas:
                for t in range(config.tp):
                    g = group_of([config.rank_of(pp=h, dp=d, cp=k, tp=t) for h in hosts])
                    if (d, k, t) == (dp_rank, cp_rank, tp_rank) and pp_rank in hosts:
                        replica[c] = g
    return PipelineGroups(reduce, stage, tie, replica)
