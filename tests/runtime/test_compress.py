"""Gradient compression (Ok-Topk and its baselines) on 4 gloo ranks.

Two launches: tests/runtime/compress_harness.py runs the compressors on small tensors (the
hand-computed example, conservation of gradient mass through error feedback, density 1); the
layout harness (tests/runtime/layout_harness.py) trains the tiny GPT through the step loop with
``compression`` set: 50 steps of Ok-Topk at density 1 % for its measured volume, and density 1
against the dense run in float64 with data, tensor and pipeline parallelism.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.runtime import forkrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HERE = Path(__file__).parent
RTOL = 1e-5  # the equivalence bar of tests/runtime/test_runtime_equivalence.py
TRAIN = {"steps": 5, "seed": 3, "lr": 3e-3, "timeout_s": 120, "compress_warmup": 0}
PARALLEL = {"global_batch": 8, "microbatch": 2}
VOLUME_STEPS = 50


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("compress")
    proc = subprocess.run([sys.executable, str(HERE / "compress_harness.py"), str(out)], capture_output=True,
                          text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


# (name, parallel layout, train options beyond TRAIN, float64)
RUNS: list[tuple[str, dict[str, Any], dict[str, Any], bool]] = [
    ("volume", {"dp": 4, "compression": "oktopk", "compression_density": 0.01}, {"steps": VOLUME_STEPS}, False),
    ("dp4-dense", {"dp": 4}, {}, True),
    ("dp4-oktopk-all", {"dp": 4, "compression": "oktopk", "compression_density": 1.0}, {}, True),
    ("dp2-tp2-dense", {"dp": 2, "tp": 2}, {}, True),
    ("dp2-tp2-oktopk-all", {"dp": 2, "tp": 2, "compression": "oktopk", "compression_density": 1.0}, {}, True),
    ("pp2-dp2-dense", {"dp": 2, "pp": 2}, {}, True),
    ("pp2-dp2-oktopk-all", {"dp": 2, "pp": 2, "compression": "oktopk", "compression_density": 1.0}, {}, True),
    # over the dp x cp ranks (ring attention): the same training as dp 4's
    ("dp2-cp2-oktopk-all", {"dp": 2, "cp": 2, "compression": "oktopk", "compression_density": 1.0}, {}, True),
    ("dp2-tp2-powersgd", {"dp": 2, "tp": 2, "compression": "powersgd"}, {"steps": 8, "compress_warmup": 2}, False),
    ("pp2-dp2-topka", {"dp": 2, "pp": 2, "compression": "topka", "compression_density": 0.05}, {"steps": 8},
     False),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("compress-train")
    runs = [{"name": name, "model": "gpt-tiny", "parallel": {**PARALLEL, **layout}, "train": {**TRAIN, **extra},
             "fp64": fp64} for name, layout, extra, fp64 in RUNS]
    spec = out / "runs.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    cmd = forkrun.command(4, str(HERE / "layout_harness.py"), str(spec))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=_env())
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {r["name"]: {"rows": [json.loads(x) for x in (out / f"{r['name']}.jsonl").read_text().splitlines()],
                        "params": torch.load(out / f"{r['name']}.pt")} for r in runs}


def test_hand_computed_four_rank_example(small: list[dict[str, Any]]) -> None:
    """n = 8, k = 2; rank gradients (index: value)
    r0 {0: 4, 5: 1}, r1 {0: 3, 2: 2.5}, r2 {2: 5, 7: 0.25}, r3 {5: -1.5, 6: 6}.
    Each rank's local top-2 is its support, so the sparse sum is the dense sum
    {0: 7, 2: 7.5, 5: -0.5, 6: 6, 7: 0.25}; its global top-2 is {2: 7.5, 0: 7}. Residuals keep what a
    rank selected that did not make the global top-2: r0 {5: 1}, r2 {7: 0.25}, r3 {5: -1.5, 6: 6}.
    Step 2 (zero gradients) reduces the residuals: sum {5: -0.5, 6: 6, 7: 0.25}, top-2 {6: 6, 5: -0.5};
    only r2's 0.25 stays behind."""
    want1 = torch.tensor([7, 0, 7.5, 0, 0, 0, 0, 0], dtype=torch.float64)
    residual1 = [{5: 1.0}, {}, {7: 0.25}, {5: -1.5, 6: 6.0}]
    want2 = torch.tensor([0, 0, 0, 0, 0, -0.5, 6, 0], dtype=torch.float64)
    residual2 = [{}, {}, {7: 0.25}, {}]
    for rank, res in enumerate(small):
        hand = res["hand"]
        assert torch.equal(hand["step1"], want1), rank
        assert torch.equal(hand["residual1"], _dense(residual1[rank])), rank
        assert torch.equal(hand["step2"], want2), rank
        assert torch.equal(hand["residual2"], _dense(residual2[rank])), rank
        # regions: the ranks' cut points (0,5,5), (0,2,2), (2,7,7), (5,6,6) average to (1,5,5)
        assert hand["bounds"] == [0, 1, 5, 5, 8]


def _dense(entries: dict[int, float]) -> torch.Tensor:
    v = torch.zeros(8, dtype=torch.float64)
    for i, x in entries.items():
        v[i] = x
    return v


@pytest.mark.parametrize("case", ["oktopk", "topka", "gaussiank", "powersgd", "oktopk-3ranks", "oktopk-reuse",
                                  "oktopk-split", "oktopk-counted"])
def test_error_feedback_loses_no_gradient_and_ranks_agree(small: list[dict[str, Any]], case: str) -> None:
    """Sum over ranks of (gradient + old residual) = result + sum of new residuals, every call;
    every rank ends with the same result (3 ranks: a subgroup, ring all-gather)."""
    for res in small:
        got = res.get(f"conservation-{case}")
        if got is None:  # rank 0 is outside the 3-rank group
            continue
        assert max(got["errors"]) < 1e-12
        assert max(got["spread"]) == 0.0


def test_split_and_reduce_message_variants_give_the_same_reduction(small: list[dict[str, Any]]) -> None:
    """The count in front of each message with the rest in a second one (pieces longer than the
    receive buffer; here every piece of more than one entry), and the counts all-gathered first
    (NCCL's path): the same results, selections and payload as the default gloo path."""
    for res in small:
        want = res["conservation-oktopk"]
        for variant in ("split", "counted"):
            got = res[f"conservation-oktopk-{variant}"]
            assert torch.equal(got["result"], want["result"]), variant
            assert got["nonzeros"] == want["nonzeros"] and got["sent"] == want["sent"], variant


def test_ok_topk_keeps_about_k_and_stays_under_6k(small: list[dict[str, Any]]) -> None:
    k, p = 80, 4  # the reuse case: n = 4000, density 0.02, 40 calls crossing the recompute at call 32
    for res in small:
        got = res["conservation-oktopk-reuse"]
        assert all(2 * k / 3 <= nz <= 4 * k / 3 for nz in got["nonzeros"])
        assert max(got["sent"]) <= 6 * k * (p - 1) / p


def test_density_one_is_the_dense_sum(small: list[dict[str, Any]]) -> None:
    for res in small:
        assert res["keep_all"]["error"] < 1e-12
        assert res["keep_all"]["residual"] == 0.0


def test_gtopk_keeps_k_entries_on_every_rank(small: list[dict[str, Any]]) -> None:
    assert all(res["gtopk"]["nonzeros"] == 20 for res in small)
    assert all(torch.equal(res["gtopk"]["result"], small[0]["gtopk"]["result"]) for res in small)


def test_ok_topk_volume_on_tiny_gpt_gradients_is_below_6k(trained: dict[str, dict[str, Any]]) -> None:
    """Measured payload per rank (values and indices) <= 6k(P-1)/P on every one of 50 steps."""
    rows = trained["volume"]["rows"]
    assert len(rows) == VOLUME_STEPS
    n = rows[0]["gradient_elements"]
    assert n == 120_576  # gpt-tiny
    k, p = math.ceil(n * 0.01), 4
    sent = [r["comm_elements_sent"] for r in rows]
    assert max(sent) <= 6 * k * (p - 1) / p, sent
    assert min(sent) >= 2 * k * (p - 1) / p * 0.5  # it did send: about the split-and-reduce share at least
    densities = [r["density"] for r in rows]
    assert all(d is not None and 0.5 * 0.01 < d < 2 * 0.01 for d in densities), densities
    assert all(r["comm_bytes_sent"] == 4 * r["comm_elements_sent"] for r in rows)  # fp32 values, int32 indices
    assert rows[-1]["residual_norm"] > 0 and math.isfinite(rows[-1]["loss"])
    assert rows[-1]["loss"] < rows[0]["loss"]


@pytest.mark.parametrize("layout", ["dp4", "dp2-tp2", "pp2-dp2", "dp2-cp2"])
def test_density_one_trains_like_dense_in_float64(trained: dict[str, dict[str, Any]], layout: str) -> None:
    got, want = trained[f"{layout}-oktopk-all"], trained[f"{layout}-dense" if layout != "dp2-cp2" else "dp4-dense"]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in got["rows"]]),
                               torch.tensor([r["loss"] for r in want["rows"]]), rtol=RTOL, atol=0)
    for key, value in want["params"].items():
        rel = float((got["params"][key] - value).norm() / max(float(value.norm()), 1e-30))
        assert rel <= RTOL or key.endswith("attn.k.bias"), f"{key}: {rel:.2e}"
    assert all(r["density"] is not None for r in got["rows"])  # compressed from step 0
    assert "comm_elements_sent" not in want["rows"][0]


def test_powersgd_and_topka_train_with_tensor_and_pipeline_parallelism(trained: dict[str, dict[str, Any]]) -> None:
    psgd = trained["dp2-tp2-powersgd"]["rows"]
    assert [r["density"] is None for r in psgd[:3]] == [True, True, False]  # two dense warm-up steps
    assert psgd[-1]["loss"] < psgd[0]["loss"]
    assert all(r["comm_elements_sent"] < psgd[0]["comm_elements_sent"] for r in psgd[2:])
    topka = trained["pp2-dp2-topka"]["rows"]
    assert topka[-1]["loss"] < topka[0]["loss"]
    assert all(r["density"] is not None for r in topka)
