"""Analytical cost model: pure functions from shapes, devices and placements to FLOPs, bytes,
memory and time. No I/O, no global state."""
