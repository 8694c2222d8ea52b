"""Sharing a cluster among many training jobs: Gavel's heterogeneity-aware scheduling policies, its
round-based mechanism, a trace-driven simulator, and spot-market prices.

Modules: ``throughputs`` (Gavel's measured table, cost-model predictions), ``trace`` (job traces:
read, write, generate), ``policies`` (allocations as LPs), ``packing`` (space sharing: policies over
job pairs and the mechanism placing them), ``rounds`` (priorities, placement, leases), ``simulator``,
``market`` (spot prices).
"""

from __future__ import annotations

from paratrain.cluster.policies import POLICY_NAMES, Allocation, AllocationProblem, Policy, get_policy
from paratrain.cluster.simulator import SimulationResult, simulate_cluster
from paratrain.cluster.throughputs import ThroughputTable, read_throughputs
from paratrain.cluster.trace import Job, generate_trace, read_trace

__all__ = [
    "POLICY_NAMES",
    "Allocation",
    "AllocationProblem",
    "Job",
    "Policy",
    "SimulationResult",
    "ThroughputTable",
    "generate_trace",
    "get_policy",
    "read_throughputs",
    "read_trace",
    "simulate_cluster",
]
