"""Parallel configuration: one :class:`ParallelConfig` feeds the planner, simulator and runtime."""

from paratrain.parallel.config import ParallelConfig, Recompute, ScheduleName

__all__ = ["ParallelConfig", "Recompute", "ScheduleName"]
