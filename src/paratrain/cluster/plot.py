"""Pictures of a cluster simulation: accelerators busy over time, per type."""

from __future__ import annotations

from typing import Any

from paratrain.cluster.simulator import SimulationResult

__all__ = ["plot_occupancy"]


def plot_occupancy(result: SimulationResult) -> Any:
    """A step plot of the accelerators placed per type in each round over time (hours), with each
    type's capacity dashed (a job that ends early in a round still counts to the round's end)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    for t, cap in result.accelerators.items():
        xs, ys = [], []
        for start, end, busy in result.occupancy:
            xs += [start / 3600, end / 3600]
            ys += [busy.get(t, 0), busy.get(t, 0)]
        line = ax.plot(xs, ys, label=f"{t} (of {cap})", linewidth=1.2)[0]
        ax.axhline(cap, color=line.get_color(), linestyle="--", linewidth=0.8)
    ax.set_xlabel("time (h)")
    ax.set_ylabel("accelerators placed (per round)")
    ax.set_title(f"{result.policy}: {len(result.jct_s)} jobs, avg JCT {result.avg_jct_s / 3600:.2f} h, "
                 f"makespan {result.makespan_s / 3600:.2f} h, utilization {result.utilization:.1%}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig
