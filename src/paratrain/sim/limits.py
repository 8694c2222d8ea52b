"""Sizes the interactive commands (``paratrain schedule show``, ``paratrain compare --plot``) accept.

Generating, validating and simulating a schedule costs about 15 µs of CPU per action, and a
schedule has about six actions per (rank, micro-batch, chunk, step): measured on one core,
``1f1b`` at 64 stages × 512 micro-batches (195 k actions) takes 0.8 s to generate, 0.9 s to
validate and 1.1 s to simulate with trace events. A PNG timeline draws each row's boxes of one
style in one call: 32,768 compute boxes (``1f1b``, 16 × 1024) render and save in 2.6 s. Larger
sizes are refused up front, with the limit in the message, instead of running for minutes without output; the library
functions themselves take any size.
"""

from __future__ import annotations

from collections.abc import Sized

from paratrain.errors import ConfigError

__all__ = ["MAX_SHOW_UNITS", "MAX_SHOW_ACTIONS", "MAX_PLOT_EVENTS", "MAX_SAMPLED_ACTIONS", "check_show_size",
           "check_show_actions", "check_plot_size", "check_sample_size"]

# stages × micro-batches × chunks per rank × steps: about 100 k actions, a few seconds in all.
MAX_SHOW_UNITS = 16384
MAX_SHOW_ACTIONS = 6 * MAX_SHOW_UNITS
MAX_PLOT_EVENTS = 65536
# Variable durations simulate the iteration once per draw, about 2-5 µs per action each: draws ×
# actions past this take more than a few seconds.
MAX_SAMPLED_ACTIONS = 2**20


def check_show_size(stages: int, microbatches: int, virtual_stages: int, iterations: int) -> None:
    """Refuse a schedule too large to generate, validate and simulate within seconds."""
    units = stages * microbatches * virtual_stages * iterations
    if units > MAX_SHOW_UNITS:
        raise ConfigError(
            "--stages/--microbatches",
            f"stages({stages}) × micro-batches({microbatches}) × chunks per rank({virtual_stages}) × "
            f"steps({iterations}) = {units} exceeds {MAX_SHOW_UNITS}, the size shown within seconds",
            "use fewer stages or micro-batches (the library's paratrain.sim.simulate takes any size)",
        )


def check_show_actions(actions: int, field: str) -> None:
    """Refuse a loaded schedule with more actions than :func:`check_show_size` lets through."""
    if actions > MAX_SHOW_ACTIONS:
        raise ConfigError(field, f"has {actions} actions, more than {MAX_SHOW_ACTIONS}, the size shown within "
                          "seconds", "show a smaller schedule (the library's paratrain.sim.simulate takes any size)")


def check_plot_size(events: Sized, field: str) -> None:
    """Refuse to draw more boxes than a PNG timeline renders within seconds (and stays legible)."""
    if len(events) > MAX_PLOT_EVENTS:
        raise ConfigError(field, f"the timeline has {len(events)} boxes to draw, more than {MAX_PLOT_EVENTS}",
                          "plot a smaller run (fewer stages, micro-batches or steps), or open the --trace file "
                          "in Perfetto (ui.perfetto.dev)")


def check_sample_size(actions: int, samples: int, field: str) -> None:
    """Refuse ``samples`` draws of an iteration of about ``actions`` actions when they would take
    more than seconds; the message says how many draws fit."""
    if samples * actions > MAX_SAMPLED_ACTIONS:
        fit = MAX_SAMPLED_ACTIONS // max(1, actions)
        fix = f"use {field} {fit} or fewer" if fit >= 1 else "simulate without varying durations (--duration-cv 0)"
        raise ConfigError(field, f"{samples:,} draws of an iteration of about {actions:,} actions exceed "
                          f"{MAX_SAMPLED_ACTIONS:,} simulated actions, the work done within seconds", fix)
