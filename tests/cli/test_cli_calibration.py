"""--calibration applies fitted efficiencies to the cluster of `plan` and `simulate`."""

from __future__ import annotations

import json

from tests.conftest import assert_one_line_error

from paratrain.cli.options import apply_calibration
from paratrain.plan.calibrated import FITTED_A100, VTRAIN_A100
from paratrain.spec.cluster import resolve_cluster

ARGS = [
    "--model",
    "gpt3-1.3b",
    "--cluster",
    "dgx-a100",
    "--gpus",
    "16",
    "--tp",
    "2",
    "--pp",
    "2",
    "--microbatch",
    "2",
    "--global-batch",
    "64",
    "--recompute",
    "full",
    "--json",
]


def test_apply_calibration_sets_the_fitted_figures():
    base = resolve_cluster("dgx-a100", gpus=16)
    cal = apply_calibration(base, "vtrain-a100")
    assert cal.device.gemm_efficiency == VTRAIN_A100.gemm_efficiency
    assert cal.device.host_issue_s == VTRAIN_A100.host_issue_s
    assert cal.intra_link.bandwidth_Bps == VTRAIN_A100.intra_bandwidth_Bps
    assert apply_calibration(base, "none") is base
    # By default the device preset's own fitted calibration (paratrain validate all --fit).
    default = apply_calibration(base, None)
    assert default.device.gemm_efficiency == FITTED_A100.gemm_efficiency
    assert default.device.attention_efficiency == FITTED_A100.attention_efficiency
    assert apply_calibration(resolve_cluster("cpu", gpus=2), None).device == resolve_cluster("cpu", gpus=2).device


def test_simulate_with_calibration_changes_the_prediction(run_cli):
    code, out, _ = run_cli("simulate", *ARGS, "--calibration", "none")
    assert code == 0
    code, out_cal, _ = run_cli("simulate", *ARGS, "--calibration", "vtrain-a100")
    assert code == 0
    plain, cal = json.loads(out), json.loads(out_cal)
    # For this small model the fitted host issue time and lower memory efficiency outweigh the
    # higher fitted GEMM efficiency.
    assert cal["iteration_time_s"] > plain["iteration_time_s"]


def test_unknown_calibration_is_one_line(run_cli):
    code, _, err = run_cli("simulate", *ARGS, "--calibration", "nope")
    assert_one_line_error(code, err, "--calibration", "vtrain-a100")
