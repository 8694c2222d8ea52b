"""Data shipped with paratrain: measured runs used to calibrate and validate the cost model.

``vtrain/``: Megatron-DeepSpeed iteration times on A100 and nccl-tests all-reduce tables from the
vTrain project (MIT licence; source and licence in ``vtrain/README.md`` and ``vtrain/LICENSE``).

``publicruns/``: published end-to-end training throughputs on A100 and H100, one source per row
(``publicruns/README.md``, ``publicruns/LICENCE``).

``measured/``: GPU kernel rates measured by ``paratrain calibrate --gpu PRESET`` on a real GPU of
the preset (``measured/README.md``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DATA_DIR", "VTRAIN_DIR", "vtrain_path"]

DATA_DIR = Path(__file__).resolve().parent
VTRAIN_DIR = DATA_DIR / "vtrain"


def vtrain_path(name: str = "") -> Path:
    """Path of a file (e.g. ``ground_truth_multi.csv``, ``allreduce_lut/a100``) of the vTrain data."""
    return VTRAIN_DIR / name if name else VTRAIN_DIR
