"""Discrete-event simulation of a schedule on a cluster: times, bubbles, memory, communication."""

from paratrain.sim.engine import CommRecord, SimRun, TraceEvent, run_schedule
from paratrain.sim.report import (
    MemoryBreakdown,
    SimResult,
    memory_by_rank,
    simulate,
    simulate_config,
    timing_for_config,
)
from paratrain.sim.timing import Timing, uniform_timing
from paratrain.sim.variability import scaled_timing, simulate_variable

__all__ = [
    "CommRecord",
    "MemoryBreakdown",
    "SimResult",
    "SimRun",
    "Timing",
    "TraceEvent",
    "memory_by_rank",
    "run_schedule",
    "scaled_timing",
    "simulate",
    "simulate_config",
    "simulate_variable",
    "timing_for_config",
    "uniform_timing",
]
