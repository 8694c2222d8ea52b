"""Deep Gradient Compression's corrections (``runtime/compress/momentum.py``): momentum correction,
momentum factor masking, local clipping and the density warm-up.

Single-process examples worked by hand, then one 4-rank launch of the layout harness: with
density 1 and no masking, momentum correction must train exactly like dense SGD with momentum in
float64 (data, tensor and pipeline parallelism), and at density 1 % the density ramp is followed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tests.runtime import forkrun

from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.compress.momentum import (
    MomentumCorrection,
    ResidualLrScaling,
    clip_local_,
    density_at,
    live_entries,
)
from paratrain.runtime.config import TrainConfig, check_compression

HERE = Path(__file__).parent


class LocalTopk:
    """A one-rank sparse compressor with error feedback (the contract every sparse compressor keeps:
    ``flat`` becomes what was sent, the residual keeps the rest, sent entries' residual is 0)."""

    def __init__(self, k: int) -> None:
        self.k, self.residual = k, None

    def reduce(self, flat: torch.Tensor) -> None:
        acc = flat.clone() if self.residual is None else self.residual + flat
        idx = acc.abs().topk(self.k).indices
        flat.zero_()
        flat[idx] = acc[idx]
        acc[idx] = 0
        self.residual = acc


def _dgc_step(mc: MomentumCorrection, comp: LocalTopk, g: list[float], masking: bool) -> torch.Tensor:
    flat = torch.tensor(g, dtype=torch.float64)
    mc.accumulate(flat)
    live = live_entries(comp.residual, flat)
    comp.reduce(flat)
    if masking:
        mc.mask(live & (comp.residual == 0))
    return flat


def test_momentum_correction_and_masking_by_hand() -> None:
    """DGC Algorithm 1 with m = 0.5, k = 1, gradients (4, 1, -2) then (0, 2, 0) then (0, 2, 0).

    Step 1: u = (4, 1, -2), v = u, send entry 0 (4); v = (0, 1, -2); masking zeroes u[0]: u = (0, 1, -2).
    Step 2: u = 0.5·u + g = (0, 2.5, -1), v = (0, 3.5, -3), send entry 1 (3.5); u = (0, 0, -1).
    Step 3: u = (0, 2, -0.5), v = (0, 2, -3.5), send entry 2 (-3.5); u = (0, 2, 0).
    Without masking the sent entry's momentum keeps pushing it: step 2 has u = (2, 2.5, -1),
    v = (2, 3.5, -3), send entry 1; step 3 has u = (1, 3.25, -0.5), v = (3, 3.25, -3.5), send entry 2,
    and entry 0, sent at step 1, has 3 back in the residual.
    """
    mc, comp = MomentumCorrection(0.5), LocalTopk(1)
    sent = [_dgc_step(mc, comp, g, masking=True) for g in ([4, 1, -2], [0, 2, 0], [0, 2, 0])]
    assert [s.tolist() for s in sent] == [[4, 0, 0], [0, 3.5, 0], [0, 0, -3.5]]
    assert mc.u.tolist() == [0, 2, 0] and comp.residual.tolist() == [0, 2, 0]

    mc, comp = MomentumCorrection(0.5), LocalTopk(1)
    sent = [_dgc_step(mc, comp, g, masking=False) for g in ([4, 1, -2], [0, 2, 0], [0, 2, 0])]
    assert [s.tolist() for s in sent] == [[4, 0, 0], [0, 3.5, 0], [0, 0, -3.5]]
    assert mc.u.tolist() == [1, 3.25, -0.5] and comp.residual.tolist() == [3, 3.25, 0]


def test_density_one_without_masking_is_heavy_ball_momentum() -> None:
    """Sending everything sends u each step: the classical momentum buffer of torch's SGD."""
    torch.manual_seed(0)
    grads = [torch.randn(6, dtype=torch.float64) for _ in range(5)]
    mc, comp = MomentumCorrection(0.9), LocalTopk(6)
    buf = None
    for g in grads:
        buf = g.clone() if buf is None else 0.9 * buf + g
        torch.testing.assert_close(_dgc_step(mc, comp, g.tolist(), masking=False), buf, rtol=1e-15, atol=0)
    # with masking every u is zeroed after it is sent: plain SGD
    mc, comp = MomentumCorrection(0.9), LocalTopk(6)
    for g in grads:
        torch.testing.assert_close(_dgc_step(mc, comp, g.tolist(), masking=True), g, rtol=0, atol=0)


def test_density_ramp_is_geometric_from_a_quarter() -> None:
    assert density_at(0, 0.01, 10) == 0.25
    assert density_at(5, 0.01, 10) == pytest.approx(math.sqrt(0.25 * 0.01))  # halfway in log space
    assert density_at(10, 0.01, 10) == density_at(50, 0.01, 10) == 0.01
    assert density_at(0, 0.5, 10) == 0.5  # a target above the first stage is used from the start
    assert density_at(3, 0.01, 0) == 0.01


def _executors(comp: LocalTopk) -> list[Any]:
    """The two places an executor holds its reductions: data parallelism's one, a pipeline's per chunk."""
    return [SimpleNamespace(grad_sync=SimpleNamespace(reducer=SimpleNamespace(compressor=comp))),
            SimpleNamespace(reducers=[SimpleNamespace(compressor=comp)])]


def test_residuals_are_found_where_the_executors_keep_them() -> None:
    """residuals_of reads the pipeline's public ``reducers`` and the sparse gradient sync's
    ``reducer``: were either renamed, the rescaling would silently stop applying."""
    import inspect

    from paratrain.runtime.compress.sync import CompressedGradSync
    from paratrain.runtime.pipeline import PipelineExecutor

    assert isinstance(inspect.getattr_static(PipelineExecutor, "reducers"), property)
    assert "self.reducer = " in inspect.getsource(CompressedGradSync.__init__)


def test_lr_weighted_residual_by_hand() -> None:
    """k = 1, lr 0.5 then 1. Step 0: g = (2, 1), entry 0 sent: applied 0.5·2 = 1; residual (0, 1).
    Step 1: the residual becomes (0, 0.5·1/1) = (0, 0.5); g = (0, 0.25), entry 1 sent (0.75): applied
    1·0.75 = 0.5·1 + 1·0.25, what dense SGD applied to that entry; raw units would apply 1.25."""
    for executor in _executors(comp := LocalTopk(1)):
        comp.residual, scaling, applied = None, ResidualLrScaling(), []
        for lr, g in ((0.5, [2.0, 1.0]), (1.0, [0.0, 0.25])):
            scaling.before_step(executor, lr)
            flat = torch.tensor(g, dtype=torch.float64)
            comp.reduce(flat)
            applied.append((lr * flat).tolist())
        assert applied == [[1.0, 0.0], [0.0, 0.75]]


def test_lr_weighted_residual_keeps_every_lr_weighted_gradient() -> None:
    """Closed form: after any steps, what was applied plus the residual at the last step's lr is
    Σ lr_j·g_j entry by entry (nothing lost or amplified), under warm-up and cosine decay alike.
    A step at lr 0 (a cosine decay to 0 ends there) rescales nothing."""
    torch.manual_seed(1)
    lrs = [0.01, 0.04, 0.1, 0.1, 0.07, 0.03, 0.01]
    grads = [torch.randn(50, dtype=torch.float64) for _ in lrs]
    comp, scaling = LocalTopk(5), ResidualLrScaling()
    executor = _executors(comp)[0]
    applied = torch.zeros(50, dtype=torch.float64)
    for lr, g in zip(lrs, grads, strict=True):
        scaling.before_step(executor, lr)
        flat = g.clone()
        comp.reduce(flat)
        applied += lr * flat
    want = sum(lr * g for lr, g in zip(lrs, grads, strict=True))
    torch.testing.assert_close(applied + 0.01 * comp.residual, want, rtol=1e-12, atol=1e-15)
    assert ResidualLrScaling.factor(None, 0.1) == ResidualLrScaling.factor(0.1, 0.1) == 1.0
    assert ResidualLrScaling.factor(0.1, 0.0) == 1.0 and ResidualLrScaling.factor(0.1, 0.05) == 2.0


def test_local_clipping_uses_the_ranks_share_of_the_threshold() -> None:
    """4 ranks, global threshold 1: a rank's contribution g/4 may have norm 1/sqrt(4), so ||g|| <= 2."""
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # ||(a, b)|| = 5
    clip_local_([a, b], 1.0, 4)
    torch.testing.assert_close(torch.cat([a, b]).norm(), torch.tensor(2.0), rtol=1e-6, atol=0)
    torch.testing.assert_close(a / b, torch.tensor([0.75, 0.0]))  # direction kept
    small = torch.tensor([0.5, 0.5])
    clip_local_([small], 1.0, 4)
    assert small.tolist() == [0.5, 0.5]
    clip_local_([a], math.inf, 4)  # no clipping
    assert a.tolist() == pytest.approx([1.2, 0.0])


@pytest.mark.parametrize(("parallel", "train", "flag"), [
    ({"dp": 4}, {"compress_momentum_correction": True, "optimizer": "sgd"}, "--compress-momentum-correction"),
    ({"dp": 4, "compression": "powersgd"}, {"compress_momentum_correction": True, "optimizer": "sgd"},
     "--compress-momentum-correction"),
    ({"dp": 1, "tp": 2, "compression": "oktopk"}, {"compress_density_warmup": 10}, "--compress-density-warmup"),
])
def test_dgc_needs_a_sparse_data_parallel_reduction(parallel: dict[str, Any], train: dict[str, Any],
                                                    flag: str) -> None:
    with pytest.raises(ConfigError) as err:
        check_compression(ParallelConfig(**parallel), TrainConfig(**train))
    assert err.value.field == flag


def test_momentum_correction_needs_sgd() -> None:
    with pytest.raises(ConfigError) as err:
        TrainConfig(compress_momentum_correction=True)
    assert err.value.field == "--compress-momentum-correction"
    with pytest.raises(ConfigError):
        TrainConfig(compress_density_warmup=-1)


# ---- 4 ranks: the step loop ------------------------------------------------------------------
RTOL = 1e-5  # tests/runtime/test_runtime_equivalence.py's bar
SGD = {"steps": 5, "seed": 3, "lr": 0.1, "optimizer": "sgd", "grad_clip": 1e9, "timeout_s": 120,
       "compress_warmup": 0}
MC = {"compress_momentum_correction": True, "compress_momentum_masking": False}
ALL = {"compression": "oktopk", "compression_density": 1.0}
RUNS: list[tuple[str, dict[str, Any], dict[str, Any], bool]] = [
    ("dp4-dense", {"dp": 4}, {}, True),
    ("dp4-mc-all", {"dp": 4, **ALL}, MC, True),
    ("dp2-tp2-dense", {"dp": 2, "tp": 2}, {}, True),
    ("dp2-tp2-mc-all", {"dp": 2, "tp": 2, **ALL}, MC, True),
    ("pp2-dp2-dense", {"dp": 2, "pp": 2}, {}, True),
    ("pp2-dp2-mc-all", {"dp": 2, "pp": 2, **ALL}, MC, True),
    ("dp4-dgc", {"dp": 4, "compression": "oktopk", "compression_density": 0.01},
     {"steps": 8, "compress_warmup": 2, "compress_momentum_correction": True, "compress_density_warmup": 4,
      "grad_clip": 1.0}, False),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("compress-momentum")
    runs = [{"name": name, "model": "gpt-tiny", "parallel": {"global_batch": 8, "microbatch": 2, **layout},
             "train": {**SGD, **extra}, "fp64": fp64} for name, layout, extra, fp64 in RUNS]
    spec = out / "runs.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = forkrun.command(4, str(HERE / "layout_harness.py"), str(spec))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {r["name"]: {"rows": [json.loads(x) for x in (out / f"{r['name']}.jsonl").read_text().splitlines()],
                        "params": torch.load(out / f"{r['name']}.pt")} for r in runs}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp4", "dp2-tp2", "pp2-dp2"])
def test_momentum_correction_at_density_one_is_dense_sgd_in_float64(trained: dict[str, dict[str, Any]],
                                                                   layout: str) -> None:
    got, want = trained[f"{layout}-mc-all"], trained[f"{layout}-dense"]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got["rows"]]),
                               torch.tensor([r["loss"] for r in want["rows"]]), rtol=RTOL, atol=0)
    for key, value in want["params"].items():
        rel = float((got["params"][key] - value).norm() / max(float(value.norm()), 1e-30))
        assert rel <= RTOL or key.endswith("attn.k.bias"), f"{key}: {rel:.2e}"  # k's bias has no gradient
    assert all(r["density"] is not None for r in got["rows"])  # compressed from step 0


@pytest.mark.dist
@pytest.mark.slow
def test_dgc_follows_the_density_ramp_and_trains(trained: dict[str, dict[str, Any]]) -> None:
    rows = trained["dp4-dgc"]["rows"]
    assert [r["density"] for r in rows[:2]] == [None, None]  # two dense warm-up steps
    ramp = [density_at(i, 0.01, 4) for i in range(6)]  # 0.25 ... 0.01
    for row, want in zip(rows[2:], ramp, strict=True):
        assert 0.5 * want < row["density"] < 2 * want, (row["density"], want)
    assert rows[2]["density"] > 10 * rows[-1]["density"]
    assert math.isfinite(rows[-1]["loss"]) and rows[-1]["loss"] < rows[0]["loss"]
