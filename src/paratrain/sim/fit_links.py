"""Fit the ``cpu`` cluster's link to measured message times (``paratrain calibrate``).

The one-way times of a gloo send/recv ping-pong over a few message sizes
(:func:`paratrain.runtime.calibrate_comm.measure_comm`) are fitted with Hockney's model
``time = alpha + bytes / beta`` (Hockney 1994) by least squares; alpha and beta become the link
latency and bandwidth of the ``cpu`` cluster preset (``cpu-cluster.json``, read by
:func:`paratrain.spec.cluster_presets.cpu_links`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypedDict

__all__ = ["LinksDocument", "fit_alpha_beta", "links_document"]


class LinksDocument(TypedDict):
    """The contents of ``cpu-cluster.json``."""

    p2p_latency_s: float  # the fitted alpha
    p2p_bandwidth_Bps: float  # the fitted beta
    p2p_s_by_bytes: dict[str, float]  # measured one-way times by message bytes
    allreduce_s_by_bytes: dict[str, float]
    procs: int
    threads: int
    cores: int  # cores the processes shared (0: not recorded); the device's rates are per core
    # tensor-parallel collectives in lockstep with compute: [kind, group size, bytes, seconds]
    measured_collectives: list[list[str | int | float]]
    # the CPU each of them cost a process: [kind, group size, bytes, seconds]
    collective_cpu: list[list[str | int | float]]
    # collectives alone (no compute), every group of that size at once: [kind, group size, bytes, seconds]
    measured_reductions: list[list[str | int | float]]
    # one-way p2p while every other process computes: ["p2p", 2, bytes, seconds]
    measured_p2p: list[list[str | int | float]]


def fit_alpha_beta(sizes_bytes: list[float], times_s: list[float]) -> tuple[float, float]:
    """Least-squares ``(alpha_s, beta_Bps)`` of ``time = alpha + bytes / beta`` (Hockney 1994).

    A fit whose slope is not positive (all sizes equally fast) falls back to the largest message's
    rate; a negative intercept is clipped to 0 (the line is then refitted through the origin).
    """
    n = len(sizes_bytes)
    if n != len(times_s) or n < 2:
        raise ValueError("need at least two (size, time) points")
    mx, my = sum(sizes_bytes) / n, sum(times_s) / n
    sxx = sum((x - mx) ** 2 for x in sizes_bytes)
    sxy = sum((x - mx) * (y - my) for x, y in zip(sizes_bytes, times_s, strict=True))
    slope = sxy / sxx if sxx > 0 else 0.0
    alpha = my - slope * mx
    if slope <= 0:
        i = max(range(n), key=lambda k: sizes_bytes[k])
        return min(times_s), sizes_bytes[i] / times_s[i]
    if alpha < 0:
        slope = sum(x * y for x, y in zip(sizes_bytes, times_s, strict=True)) / sum(x * x for x in sizes_bytes)
        alpha = 0.0
    return alpha, 1.0 / slope


def links_document(
    p2p_s_by_bytes: Mapping[int, float], allreduce_s_by_bytes: Mapping[int, float], procs: int, threads: int,
    measured_collectives: Sequence[tuple[str, int, int, float]] = (), cores: int = 0,
    collective_cpu: Sequence[tuple[str, int, int, float]] = (),
    measured_reductions: Sequence[tuple[str, int, int, float]] = (),
    measured_p2p: Sequence[tuple[str, int, int, float]] = (),
) -> LinksDocument:
    """What ``cpu-cluster.json`` holds: the link fitted to the ping-pong's one-way times, the raw
    timings (keys: message bytes as strings) and the tensor-parallel collectives as measured
    and the CPU they cost (read by the ``cpu`` cluster preset as its ``measured_collectives`` and
    ``collective_cpu_s``), the all-reduces timed alone (its ``measured_reductions``) and the
    ping-pong under load (its ``measured_p2p``)."""
    alpha, beta = fit_alpha_beta([float(n) for n in p2p_s_by_bytes], list(p2p_s_by_bytes.values()))
    return {
        "p2p_latency_s": alpha,
        "p2p_bandwidth_Bps": beta,
        "p2p_s_by_bytes": {str(k): v for k, v in p2p_s_by_bytes.items()},
        "allreduce_s_by_bytes": {str(k): v for k, v in allreduce_s_by_bytes.items()},
        "procs": procs,
        "threads": threads,
        "cores": cores,
        "measured_collectives": [list(row) for row in measured_collectives],
        "collective_cpu": [list(row) for row in collective_cpu],
        "measured_reductions": [list(row) for row in measured_reductions],
        "measured_p2p": [list(row) for row in measured_p2p],
    }
