"""Asynchronous pipelines without a flush.

**PipeDream** (Narayanan et al., SOSP'19): 1F1B over an endless stream of micro-batches, each one a
mini-batch with its own optimizer step on every stage right after its backward. Weight stashing:
the backward of a micro-batch uses the weights its forward used, so rank ``r`` keeps
``p - r`` versions (its ``p-1-r`` warm-up forwards plus the current one; msr-fiddle/pipedream
``optimizer.py`` keeps ``num_versions = warmup + 1``).

**PipeDream-2BW** (Narayanan et al., ICML'21): gradients are coalesced over the ``M`` micro-batches
of a batch and every rank steps once per batch, after the batch's last backward. Batch ``t`` runs
entirely on weight version ``t-1`` (version 0 for the first batch): ``W(t+1) = W(t) - ν∇f(W(t-1))``.
At most two versions are alive on any rank, which needs ``M ≥ p`` (paper, Sec. 3.1): the forwards of
batch ``t`` start only after the step that produced version ``t-1``.

Both are generated over ``iterations`` batches of ``M`` micro-batches (micro-batch ``k·M + i`` is the
``i``-th of batch ``k``); the pipeline fills once at the start and drains once at the end, so the
batches in between show the steady state. Actions carry the weight version to use.
"""

from __future__ import annotations

from paratrain.errors import ConfigError
from paratrain.schedule._common import K, build, check_counts, plain_placement
from paratrain.schedule.ir import Action, Schedule
from paratrain.schedule.one_f_one_b import one_f_one_b_order

__all__ = ["pipedream", "pipedream_2bw", "pipedream_rules", "pipedream_2bw_rules", "DEFAULT_ASYNC_ITERATIONS"]

# Batches generated for asynchronous schedules: fill, two steady-state batches, drain.
DEFAULT_ASYNC_ITERATIONS = 4


def _check_iterations(iterations: int) -> None:
    if not isinstance(iterations, int) or iterations < 1:
        raise ConfigError("iterations", f"must be a positive integer, got {iterations!r}", "use e.g. 4")


def pipedream_rules(stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    """Any positive counts, one chunk per rank."""
    check_counts("pipedream", stages, microbatches, virtual_stages)


def pipedream_2bw_rules(stages: int, microbatches: int, virtual_stages: int = 1) -> None:
    """At least as many micro-batches as stages (two weight versions suffice only then), one chunk per rank."""
    check_counts("2bw", stages, microbatches, virtual_stages)
    if microbatches < stages:
        raise ConfigError(
            "microbatches",
            f"PipeDream-2BW needs at least as many micro-batches as stages, got {microbatches} < {stages}",
            f"use at least {stages} micro-batches (two weight versions suffice only then)",
        )


def pipedream(stages: int, microbatches: int, iterations: int = DEFAULT_ASYNC_ITERATIONS) -> Schedule:
    pipedream_rules(stages, microbatches)
    _check_iterations(iterations)
    p, total = stages, microbatches * iterations
    rows = []
    for r in range(p):
        steps = 0
        version_of: dict[int, int] = {}
        row: list[Action] = []
        for a in one_f_one_b_order(r, p, list(range(total)), r):
            if a.kind is K.FORWARD:
                version_of[a.microbatch] = steps
                row.append(Action(K.FORWARD, a.microbatch, r, version=steps))
            else:
                row.append(Action(K.BACKWARD, a.microbatch, r, version=version_of.pop(a.microbatch)))
                row.append(Action(K.REDUCE_GRAD, None, r))
                row.append(Action(K.OPTIMIZER_STEP))
                steps += 1
        rows.append(row)
    return build("pipedream", p, microbatches, plain_placement(p), rows, iterations=iterations)


def pipedream_2bw(stages: int, microbatches: int, iterations: int = DEFAULT_ASYNC_ITERATIONS) -> Schedule:
    pipedream_2bw_rules(stages, microbatches)
    _check_iterations(iterations)
    p, m = stages, microbatches
    total = m * iterations
    rows = []
    for r in range(p):
        row: list[Action] = []
        for a in one_f_one_b_order(r, p, list(range(total)), r):
            batch = a.microbatch // m
            version = max(batch - 1, 0)
            row.append(Action(a.kind, a.microbatch, r, version=version))
            if a.kind is K.BACKWARD and a.microbatch % m == m - 1:
                row.append(Action(K.REDUCE_GRAD, None, r))
                row.append(Action(K.OPTIMIZER_STEP))
        rows.append(row)
    return build("2bw", p, m, plain_placement(p), rows, iterations=iterations)
