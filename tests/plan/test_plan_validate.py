"""vTrain CSV parsing and the mapping of a measured run onto specs."""

from __future__ import annotations

import pytest

from paratrain.errors import ConfigError
from paratrain.plan.calibrated import VTRAIN_A100
from paratrain.plan.validate import (
    errors_pct,
    megatron_predictor,
    parse_vtrain_csv,
    run_config,
    run_model,
    summary,
    vtrain_cluster,
)
from paratrain.spec.cluster import resolve_cluster

HEADER_MULTI = (
    "\ufeffParameters (billion),# GPUs,global batch,micro batch,hidden size,attention heads,# layers,"
    "sequence length,tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)\n"
)


def test_parses_bom_and_column_order():
    runs = parse_vtrain_csv(HEADER_MULTI + "3.6,64,512,8,3072,32,30,2048,2,32,1,3975.2\n")
    (r,) = runs
    assert (r.tp, r.dp, r.pp) == (2, 32, 1)  # TP, DP, PP: data parallelism is the middle column
    assert r.time_s == pytest.approx(3.9752) and r.line == 2


def test_run_maps_to_megatron_setup():
    (r,) = parse_vtrain_csv(HEADER_MULTI + "3.6,64,512,8,3072,32,30,2048,2,32,1,3975.2\n")
    model, cfg = run_model(r), run_config(r)
    assert model.vocab % (128 * 2) == 0 and 50257 <= model.vocab < 50257 + 256  # Megatron's padding
    assert (model.hidden, model.heads, model.layers, model.seq) == (3072, 32, 30, 2048)
    assert cfg.recompute.value == "full" and cfg.schedule.value == "1f1b" and cfg.num_microbatches == 2


def test_cluster_sizing_and_calibration():
    base = resolve_cluster("dgx-a100")
    c = vtrain_cluster(base, 64, VTRAIN_A100)
    assert c.num_devices == 64 and c.nodes == 8
    assert c.inter_link.bandwidth_Bps == pytest.approx(800e9 / 8 / 8 * VTRAIN_A100.link_efficiency)
    assert c.intra_link.bandwidth_Bps == VTRAIN_A100.intra_bandwidth_Bps
    assert c.device.kernel_overhead_s == VTRAIN_A100.kernel_overhead_s
    assert c.device.host_issue_s == VTRAIN_A100.host_issue_s > 0


def test_errors_and_summary():
    runs = parse_vtrain_csv(
        HEADER_MULTI + "3.6,64,512,8,3072,32,30,2048,2,32,1,1000\n3.6,64,512,8,3072,32,30,2048,2,32,1,2000\n"
    )
    errs = errors_pct(runs, [1.1, 1.8])
    assert errs == pytest.approx([10.0, -10.0])
    s = summary(errs)
    assert s["mean_abs_error_pct"] == pytest.approx(10.0) and s["mean_error_pct"] == pytest.approx(0.0)


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "empty"),
        (HEADER_MULTI, "no data rows"),
        (HEADER_MULTI + "3.6,64,512,x,3072,32,30,2048,2,32,1,3975.2\n", "line 2"),
        (HEADER_MULTI + "3.6,64,512,8,3072,32,30,2048,2,32,1,-1\n", "non-positive"),
        (HEADER_MULTI + "3.6,64,512,8,3072,32,30,2048,2,32,1,nan\n", "time_ms is 'nan', not a finite number"),
        (HEADER_MULTI + "3.6,64,512,8,3072,32,30,2048,2,32,1,inf\n", "time_ms is 'inf', not a finite number"),
        (HEADER_MULTI + "3.6,64,512,8,3072,32,30,2048,2,inf,1,100\n", "dp is 'inf', not a finite number"),
        (HEADER_MULTI + "3.6,64,512,8.5,3072,32,30,2048,2,32,1,100\n", "microbatch is '8.5', not a whole number"),
        # A billion GPUs: refused by the layout's limits on the line, not simulated.
        (HEADER_MULTI + "1,1000000000,1000000000,1,1024,16,24,1024,1,1000000000,1,100\n", "line 2: dp"),
        (HEADER_MULTI + "3.6,64,512,8,3072,32,30,4000000000,2,32,1,100\n", "line 2: seq"),
    ],
)
def test_bad_csv(text, needle):
    with pytest.raises(ConfigError, match=needle) as ei:
        parse_vtrain_csv(text)
    assert "fix:" in str(ei.value) and "\n" not in str(ei.value)


@pytest.mark.parametrize("name, rows", [("ground_truth_multi.csv", 109), ("ground_truth_single.csv", 1440)])
def test_shipped_data_parses(name, rows):
    """The measured runs ship inside the package, with their source and licence."""
    from paratrain.data import VTRAIN_DIR, vtrain_path

    runs = parse_vtrain_csv(vtrain_path(name).read_text(encoding="utf-8-sig"), name)
    assert len(runs) == rows
    assert all(r.tp * r.dp * r.pp == r.gpus and r.time_s > 0 for r in runs)
    assert "MIT" in (VTRAIN_DIR / "README.md").read_text() and "Permission is hereby granted" in (
        VTRAIN_DIR / "LICENSE"
    ).read_text()
    luts = sorted((VTRAIN_DIR / "allreduce_lut" / "a100").glob("AR_GPU*_LUT.csv"))
    assert [int(p.name.split("_")[1][3:]) for p in luts] == list(range(2, 9))


def test_predict_reports_progress():
    from paratrain.plan.validate import predict

    runs = parse_vtrain_csv(
        HEADER_MULTI + "3.6,64,512,8,3072,32,30,2048,2,32,1,1000\n3.6,64,512,8,3072,32,30,2048,2,32,1,2000\n"
    )
    seen: list[tuple[int, int]] = []
    out = predict(runs, resolve_cluster("dgx-a100"), VTRAIN_A100, megatron_predictor("analytic"),
                  progress=lambda d, t: seen.append((d, t)))
    assert len(out) == 2 and seen == [(1, 2), (2, 2)]


HEADER_SINGLE = (
    "# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,"
    "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)\n"
)


@pytest.mark.parametrize(
    "row",
    [
        "8,32,4,1024,16,24,1024,2,2,2,219.7",  # single node, pp 2
        "8,8,1,2048,16,20,1024,2,1,4,100.0",  # pp 4, host-bound micro-batch of 1
    ],
)
def test_simulator_and_closed_forms_agree_on_megatron_runs(row):
    (r,) = parse_vtrain_csv(HEADER_SINGLE + row + "\n")
    c = vtrain_cluster(resolve_cluster("dgx-a100"), r.gpus, VTRAIN_A100)
    sim = megatron_predictor("sim")(run_model(r), c, run_config(r))
    ana = megatron_predictor("analytic")(run_model(r), c, run_config(r))
    assert ana == pytest.approx(sim, rel=0.03)


def test_megatron_runs_use_fused_kernels():
    from paratrain.cost.stage import chunk_costs
    from paratrain.sim import simulate_config

    (r,) = parse_vtrain_csv(HEADER_MULTI + "18.4,256,1024,4,6144,48,40,2048,2,32,4,10825\n")
    model, cfg = run_model(r), run_config(r)
    c = vtrain_cluster(resolve_cluster("dgx-a100"), r.gpus, VTRAIN_A100)
    # Fused element-wise kernels move fewer bytes than the unfused ones the planner assumes.
    assert chunk_costs(model, c, cfg, fused=True)[0].forward_s < chunk_costs(model, c, cfg)[0].forward_s
    assert megatron_predictor("sim")(model, c, cfg) < simulate_config(model, c, cfg).iteration_time_s


def test_unknown_engine():
    with pytest.raises(ConfigError, match="engine"):
        megatron_predictor("exact")
