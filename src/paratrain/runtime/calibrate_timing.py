"""Timing primitives of ``paratrain calibrate``'s CPU measurements: the best or the mean call of a
kernel under a deadline, two kernels timed call for call, the variation of call times, and the
correction of a time for the host's drift against a reference kernel."""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["best_time", "mean_time", "paired_times", "drift_corrected", "variation"]


def best_time(fn: Any, *, repeats: int, deadline: float) -> float:
    """Fastest of up to ``repeats`` timed calls (after one warm-up), stopping at ``deadline``
    (a ``time.perf_counter()`` value) once at least one call was timed."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if t1 > deadline:
            break
    return best


def mean_time(fn: Any, *, repeats: int, deadline: float) -> float:
    """Mean time of back-to-back calls (after one warm-up) until ``deadline``, at least three:
    total time over calls, so that the time slices other processes take are counted in the
    proportion a long run of such calls loses to them."""
    fn()
    n = 0
    t0 = time.perf_counter()
    while True:
        fn()
        n += 1
        t1 = time.perf_counter()
        if t1 > deadline and n >= 3:
            return (t1 - t0) / n


def paired_times(fn_a: Any, fn_b: Any, *, best: bool, deadline: float) -> tuple[float, float]:
    """Times of ``fn_a`` and ``fn_b`` called alternately (after one warm-up each) until ``deadline``,
    at least three pairs: the fastest call of each with ``best``, else each one's mean (what
    :func:`best_time` and :func:`mean_time` give), both under the same load."""
    fn_a(), fn_b()
    ta: list[float] = []
    tb: list[float] = []
    while True:
        t0 = time.perf_counter()
        fn_a()
        t1 = time.perf_counter()
        fn_b()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
        if t2 > deadline and len(ta) >= 3:
            pick = min if best else statistics.fmean
            return pick(ta), pick(tb)


def drift_corrected(seconds: float, reference_now_s: float, reference_then_s: float) -> float:
    """``seconds`` measured while a reference kernel took ``reference_now_s``, as it would have
    been when the reference took ``reference_then_s`` (the rate the calibration stores): a host
    slower now by some factor made ``seconds`` longer by the same factor."""
    if reference_now_s <= 0:
        raise ValueError(f"reference time must be positive, got {reference_now_s!r}")
    return seconds * reference_then_s / reference_now_s


def variation(fn: Any, *, deadline: float) -> float:
    """Coefficient of variation (standard deviation / mean) of back-to-back call times, after
    one warm-up, until ``deadline`` (at least five calls)."""
    fn()
    ts: list[float] = []
    while True:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        ts.append(t1 - t0)
        if t1 > deadline and len(ts) >= 5:
            return statistics.pstdev(ts) / statistics.fmean(ts)
