"""Discrete-event simulation of a schedule on a cluster: times, bubbles, memory, communication."""

from paratrain.sim.engine import CommRecord, SimRun, Timing, TraceEvent, run_schedule, uniform_timing
from paratrain.sim.report import (
    MemoryBreakdown,
    SimResult,
    memory_by_rank,
    simulate,
    simulate_config,
    timing_for_config,
)

__all__ = [
    "CommRecord",
    "MemoryBreakdown",
    "SimResult",
    "SimRun",
    "Timing",
    "TraceEvent",
    "memory_by_rank",
    "run_schedule",
    "simulate",
    "simulate_config",
    "timing_for_config",
    "uniform_timing",
]
