"""Host counters around a measured loader run: wall time, CPU time of this process and its
(joined) DataLoader workers, the host's CPU utilization, and bytes read from block devices.

Read from ``/proc`` and ``resource`` (Linux); a counter this machine does not expose is ``None``.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

__all__ = ["Counters", "RunStats", "read_counters", "difference", "cpu_cores"]

SECTOR_BYTES = 512  # /proc/diskstats counts 512-byte sectors whatever the device's own sector size


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Counters:
    wall_s: float
    own_cpu_s: float  # this process + children it has waited for (DataLoader workers once joined)
    host_busy: int | None  # /proc/stat jiffies
    host_total: int | None
    disk_read_bytes: int | None


def _host_jiffies() -> tuple[int | None, int | None]:
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None, None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _disk_read_bytes() -> int | None:
    try:
        with open("/proc/diskstats", encoding="ascii") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        parts = line.split()
        name = parts[2]
        # whole disks only (partitions would count twice); loop and ram devices are not storage
        if name.startswith(("loop", "ram", "dm-")) or (name[-1].isdigit() and not name.startswith("nvme")):
            continue
        if name.startswith("nvme") and "p" in name[4:]:
            continue
        total += int(parts[5]) * SECTOR_BYTES
    return total


def read_counters() -> Counters:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    busy, total = _host_jiffies()
    return Counters(time.perf_counter(), me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
                    busy, total, _disk_read_bytes())


@dataclass(frozen=True)
class RunStats:
    wall_s: float
    cpu_s: float  # CPU seconds of this process and its loader workers
    cpu_util: float  # cpu_s / (wall_s * cores): the share of this machine the pipeline used
    host_cpu_util: float | None  # everything running on the host, other users included
    disk_read_bytes: int | None


def difference(a: Counters, b: Counters) -> RunStats:
    wall = max(b.wall_s - a.wall_s, 1e-9)
    cpu = b.own_cpu_s - a.own_cpu_s
    host = None
    if a.host_total is not None and b.host_total is not None and a.host_busy is not None and b.host_busy is not None:
        span = b.host_total - a.host_total
        host = (b.host_busy - a.host_busy) / span if span > 0 else None
    disk = None if a.disk_read_bytes is None or b.disk_read_bytes is None else b.disk_read_bytes - a.disk_read_bytes
    return RunStats(wall, cpu, cpu / (wall * cpu_cores()), host, disk)
