"""`paratrain calibrate --gpu PRESET`: the GPU's kernel rates as the preset's efficiencies, stored
beside the CPU calibration and applied by `--calibration measured`.

No GPU here: the measurement runs on the CPU (tiny shapes), which exercises the whole path; the
figures it stores are the CPU's, measured, and nothing is asserted about their size."""

from __future__ import annotations

import functools
import json

import pytest
from tests.conftest import assert_one_line_error

from paratrain.cli.options import apply_calibration
from paratrain.cost.gemm import gemm_tile_choice
from paratrain.errors import ConfigError
from paratrain.runtime import gpu_calibrate
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.device import resolve_device

H100 = resolve_device("h100")
TINY = dict(dtype="fp32", shapes=((64, 96, 32), (128, 64, 64)), attention_shapes=((1, 2, 64, 16), (2, 2, 32, 16)),
            copy_bytes=1 << 16, repeats=2, elementwise_shape=(64, 32))


def test_efficiencies_invert_the_cost_model():
    # Times made from the model's own formulas at chosen efficiencies come back as those efficiencies.
    gemm_eff, mem_eff, attn_eff = 0.62, 0.81, 0.44
    peak = H100.peak_flops("bf16")
    shapes = [(8192, 4096, 4096), (4096, 4096, 4096), (8192, 28672, 4096)]
    gemms = [{"m": m, "n": n, "k": k, "seconds": 2.0 * m * n * k / (peak * gemm_tile_choice(m, n, k, H100)[0] * e)}
             for (m, n, k), e in zip(shapes, (gemm_eff, 0.5, 0.9), strict=True)]
    b, h, s, d = 4, 32, 4096, 128
    executed = 4.0 * b * h * s * s * d * 0.5 * 3.5  # causal half; forward + 2.5× backward
    measured = {
        "dtype": "bf16", "gemm": gemms, "copy_bytes": 2**30,
        "copy_s": 2 * 2**30 / (H100.memory_bandwidth_Bps * mem_eff),
        "attention": {"batch": b, "heads": h, "seq": s, "head_dim": d, "causal": True,
                      "seconds": executed / (peak * gemm_tile_choice(s, s, d, H100, b * h)[0] * attn_eff)},
    }
    out = gpu_calibrate.efficiencies(measured, H100)
    assert out["gemm_efficiency"] == pytest.approx(gemm_eff)  # the median of 0.62, 0.5, 0.9
    assert out["memory_efficiency"] == out["copy_efficiency"] == pytest.approx(mem_eff)  # no element-wise times
    assert out["attention_efficiency"] == pytest.approx(attn_eff)
    assert "activation_efficiency" not in out
    # a sweep over sequences keeps the median of the per-sequence efficiencies
    a = measured["attention"]
    sweep = [{**a, "seconds": a["seconds"] * f} for f in (1.0, 2.0, 0.8)]
    out = gpu_calibrate.efficiencies({**measured, "attention": sweep}, H100)
    assert [x["efficiency"] for x in out["attention_by_seq"]] == pytest.approx([attn_eff, attn_eff / 2, attn_eff / 0.8])
    assert out["attention_efficiency"] == pytest.approx(attn_eff)
    assert [g["efficiency"] for g in out["gemm_by_shape"]] == pytest.approx([gemm_eff, 0.5, 0.9])


def test_elementwise_times_give_the_efficiencies_under_which_the_model_reproduces_them():
    """A layer's norm + residual and GeLU times made by the model (op_time_split, at chosen memory
    and activation efficiencies, kernel overheads included) come back as those efficiencies, and
    the model then prices the same operators at the measured times."""
    import dataclasses

    from paratrain.cost.compute import op_time_split

    base = dict(dtype="bf16", gemm=[{"m": 4096, "n": 4096, "k": 4096, "seconds": 1e-3}], copy_bytes=2**30,
                copy_s=1e-3, attention={"batch": 1, "heads": 1, "seq": 512, "head_dim": 64, "seconds": 1e-3})
    truth = dataclasses.replace(H100, memory_efficiency=0.47, activation_efficiency=0.61)
    ops = gpu_calibrate.elementwise_ops(8192, 4096, "bf16")
    assert [ops[k].kind for k in ("norm", "residual", "activation")] == ["norm", "elementwise", "activation"]
    t = {k: sum(op_time_split(o, truth, "bf16")) for k, o in ops.items()}
    ew = {"tokens": 8192, "hidden": 4096, "norm_s": t["norm"], "residual_s": t["residual"],
          "activation_s": t["activation"]}
    out = gpu_calibrate.efficiencies({**base, "elementwise": ew}, H100)
    assert out["memory_efficiency"] == pytest.approx(0.47) and out["activation_efficiency"] == pytest.approx(0.61)
    assert out["copy_efficiency"] == pytest.approx(2 * 2**30 / 1e-3 / H100.memory_bandwidth_Bps)
    # bytes by hand (bf16, 8192 x 4096 activations = 64 MiB; the MLP's 4x wider): norm reads x and
    # writes y, then reads dy and x and writes dx; the residual reads two and writes one, then its
    # bias gradient reads dy; GeLU reads and writes, then reads dy and u, writes du, and the bias
    # gradient reads du
    mib = 2**20
    assert ops["norm"].fwd_bytes + ops["norm"].bwd_bytes == (2 + 3) * 64 * mib
    assert ops["residual"].fwd_bytes + ops["residual"].bwd_bytes == (3 + 1) * 64 * mib
    assert ops["activation"].fwd_bytes + ops["activation"].bwd_bytes == (2 + 3 + 1) * 256 * mib
    # the host's issue time: the overhead block's time over the kernels the model counts for it
    from paratrain.runtime.calibrate import overhead_block_kernels

    out = gpu_calibrate.efficiencies({**base, "host_block_s": overhead_block_kernels() * 23e-6}, H100)
    assert out["host_issue_s"] == pytest.approx(23e-6)
    with pytest.raises(ConfigError, match="kernel overheads"):
        gpu_calibrate.efficiencies({**base, "elementwise": {**ew, "norm_s": 1e-6, "residual_s": 1e-6}}, H100)


def test_calibrate_gpu_stores_a_measured_calibration_that_calibration_measured_applies(run_cli, monkeypatch):
    monkeypatch.setattr(gpu_calibrate, "cuda_available", lambda: True)
    monkeypatch.setattr(gpu_calibrate, "measure_gpu", functools.partial(gpu_calibrate.measure_gpu, "cpu", **TINY))
    code, out, err = run_cli("calibrate", "--gpu", "h100", "--json")
    assert code == 0, err
    doc = json.loads(out)
    path = gpu_calibrate.measured_calibration_path("h100")
    assert doc["path"] == str(path) and path.is_file()
    stored = json.loads(path.read_text())
    assert stored["preset"] == "h100" and stored["measured"]["torch_device"] == "cpu"
    assert len(stored["gemm_by_shape"]) == 2 and [a["seq"] for a in stored["attention_by_seq"]] == [64, 32]
    for f in gpu_calibrate.MEASURED_FIELDS:
        assert 0 < stored[f] <= 1
    cluster = apply_calibration(resolve_cluster("dgx-h100"), "measured")
    assert cluster.device.gemm_efficiency == stored["gemm_efficiency"]
    assert cluster.device.attention_efficiency == stored["attention_efficiency"]
    assert cluster.device.activation_efficiency == stored["activation_efficiency"]
    assert cluster.device.host_issue_s == stored["host_issue_s"] > 0
    assert set(stored["measured"]["elementwise"]) == {"tokens", "hidden", "norm_s", "residual_s", "activation_s"}
    fitted = apply_calibration(resolve_cluster("dgx-h100"), None)
    assert cluster.intra_link == fitted.intra_link  # the links stay the fitted calibration's


def test_calibrate_gpu_bad_input(run_cli, monkeypatch):
    monkeypatch.setattr(gpu_calibrate, "cuda_available", lambda: False)
    assert_one_line_error(*run_cli("calibrate", "--gpu", "h100")[::2], "--gpu", "no CUDA device")
    assert_one_line_error(*run_cli("calibrate", "--gpu", "k80")[::2], "--gpu", "no bf16")
    assert_one_line_error(*run_cli("calibrate", "--gpu", "tpu9")[::2], "--gpu")
    assert_one_line_error(*run_cli("calibrate", "--gpu", "h100", "--threads", "2")[::2], "--gpu")
    with pytest.raises(ConfigError, match="calibrate --gpu h200"):
        gpu_calibrate.load_measured("h200")
    code, _, err = run_cli("simulate", "--model", "gpt3-125m", "--cluster", "dgx-a100", "--gpus", "8", "--dp", "8",
                           "--calibration", "measured")
    assert_one_line_error(code, err, "--calibration", "calibrate --gpu a100-80gb")


def test_the_shipped_h100_calibration_is_its_measured_times_and_applies_without_a_local_one(tmp_path, monkeypatch):
    """data/measured/h100.json was measured on an H100 SXM: its efficiencies follow from its own
    raw times, and `--calibration measured` uses it when this machine measured none."""
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))  # an empty cache: nothing measured here
    shipped = json.loads(gpu_calibrate.shipped_calibration_path("h100").read_text())
    assert shipped["measured"]["torch_device"] == "NVIDIA H100 80GB HBM3" and shipped["measured"]["dtype"] == "bf16"
    again = gpu_calibrate.efficiencies(shipped["measured"], H100)
    for f in gpu_calibrate.MEASURED_FIELDS:
        assert again[f] == pytest.approx(shipped[f], rel=1e-12)
    assert not gpu_calibrate.measured_calibration_path("h100").exists()
    # measured before the element-wise kernels were: its memory efficiency is the copy's, no activation rate
    assert "elementwise" not in shipped["measured"] and "activation_efficiency" not in shipped
    assert gpu_calibrate.load_measured("h100") == {f: shipped[f] for f in gpu_calibrate.MEASURED_FIELDS}
    cluster = apply_calibration(resolve_cluster("dgx-h100"), "measured")
    assert cluster.device.gemm_efficiency == shipped["gemm_efficiency"]
