"""Per-phase wall times of one compressed reduction, on when ``PARATRAIN_COMPRESS_PROFILE`` is set.

A compressor calls :meth:`Phases.start` at the top of ``reduce`` and :meth:`Phases.mark` after each
phase; each mark records the time since the previous one. Off (the default), a mark is one
attribute test: no clock read and no synchronisation added. ``bench/bench_compress.py --profile``
prints the medians per rank.
"""

from __future__ import annotations

import os
import time

__all__ = ["ENV", "Phases"]

ENV = "PARATRAIN_COMPRESS_PROFILE"


class Phases:
    """Phase name -> its wall time in each profiled call (seconds)."""

    def __init__(self) -> None:
        self.on = bool(os.environ.get(ENV))
        self.times: dict[str, list[float]] = {}
        self._last = 0.0

    def start(self) -> None:
        if self.on:
            self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        if self.on:
            now = time.perf_counter()
            self.times.setdefault(name, []).append(now - self._last)
            self._last = now
