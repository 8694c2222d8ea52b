"""Plausibility: predicted MFU against the best measured on the device for a model of that size."""

from __future__ import annotations

import json

import pytest

from paratrain.plan.plausibility import PUBLISHED, best_measured, plausibility_warnings, records
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import preset

# torchtitan's A100 table publishes MFU = (6·N + 12·L·h·s) · tokens/s / 312 TFLOP/s with N counting the
# input embedding, which paratrain's model FLOPs leave out (a lookup, no matmul): lower by the ratio
# (6·(N − V·h) + 12·L·h·s) / (6·N + 12·L·h·s).
_TORCHTITAN_A100_MFU = {19: 0.568, 20: 0.582, 21: 0.517, 22: 0.611, 23: 0.541, 24: 0.538, 25: 0.508, 26: 0.505}


def test_public_run_mfu_reproduces_the_published_figures() -> None:
    from paratrain.data import DATA_DIR
    from paratrain.plan.publicruns import parse_public_runs

    text = (DATA_DIR / "publicruns" / "h100_a100_public_runs.csv").read_text(encoding="utf-8")
    runs = {r.line: r for r in parse_public_runs(text).runs}
    by_line = {int(r.source.rsplit(" ", 1)[-1].rstrip(")")): r for r in records() if "torchtitan-a100" in r.source}
    assert sorted(by_line) == sorted(_TORCHTITAN_A100_MFU)
    params_b = {19: 8.03, 20: 8.03, 21: 70.55, 22: 13.02, 23: 13.02, 24: 13.02, 25: 68.98, 26: 68.98}
    for line, published in _TORCHTITAN_A100_MFU.items():
        r, n = runs[line], params_b[line] * 1e9
        attn = 12 * r.layers * r.hidden * r.seq
        expect = published * (6 * (n - r.vocab * r.hidden) + attn) / (6 * n + attn)
        assert by_line[line].mfu == pytest.approx(expect, rel=0.01)  # published to 3 digits, N to 4


def test_best_measured_for_gpt3_175b_on_a100_is_megatron() -> None:
    # MegaScale's Megatron-LM baseline on 256 GPUs (table 2) is above Korthikanti et al.'s 51.4 %.
    best = best_measured("a100", 175.0)
    assert best is not None and best.mfu == 0.530 and best in PUBLISHED and "MegaScale" in best.source
    megascale = [r for r in PUBLISHED if "MegaScale" in r.source]
    assert [r.gpus for r in megascale] == [256, 512, 768, 1024, 3072, 6144, 8192, 12288]
    assert best_measured("a100", 1.0) is not None  # the 1.3B runs of the public table
    assert best_measured("h100", 175.0) is not None  # torchtitan 405B and MPT-70b are within 2.5x


def test_warning_names_the_parts_that_produce_it() -> None:
    gpt = preset("gpt3-175b")
    cluster = resolve_cluster("dgx-a100", gpus=1024)
    kw = dict(bubble_fraction=0.07, exposed_comm_fraction=0.05, attention="flash")
    assert plausibility_warnings(gpt, cluster, mfu=0.55, **kw) == []  # within 5 % of 53.0 %
    (w,) = plausibility_warnings(gpt, cluster, mfu=0.60, **kw)
    assert "60.0%" in w and "53.0%" in w and "idle 7.0% (pipeline bubble and waits)" in w
    assert "exposed communication 5.0%" in w
    # The wait for the slowest rank: 1 % · sqrt(2 ln 1024) of the 88 % the ranks are busy.
    assert "slowest of 1,024 ranks about 3.3%" in w
    # The record at the planned scale (MegaScale's Megatron-LM on 1,024 GPUs) is named too.
    assert "At 1,024 GPUs the records show 44.7%" in w
    assert "--attention math" not in w  # the record's attention kernels are not published
    # A device without records (the CPU) gets no warning.
    assert plausibility_warnings(gpt, resolve_cluster("cpu", gpus=2), mfu=0.9, **kw) == []


@pytest.mark.slow
def test_gpt3_175b_plan_is_supported_by_the_megatron_record(run_cli) -> None:
    """Planned with explicit attention kernels, the calibrated model predicts 44 % … the best
    Megatron-LM record at 175B (MegaScale's 53.0 %) + 5 %, without a warning; with flash attention
    (the default) it warns exactly when it predicts more than that."""
    args = ["plan", "--model", "gpt3-175b", "--cluster", "dgx-a100", "--gpus", "1024", "--global-batch", "1536",
            "--json"]
    code, out, err = run_cli(*args, "--attention", "math")
    assert code == 0, err
    doc = json.loads(out)
    best = best_measured("a100", 175.0)
    assert best is not None
    assert 0.44 <= doc["mfu"] <= best.mfu * 1.05
    assert doc["plausibility_warnings"] == []
    code, out, err = run_cli(*args)
    doc = json.loads(out)
    assert doc["mfu"] <= 0.60  # what the model promised before the data-parallel terms: 58–63 %
    warned = doc["mfu"] > best.mfu * 1.05
    assert len(doc["plausibility_warnings"]) == warned
    if warned:
        assert "slowest of 1,024 ranks" in doc["plausibility_warnings"][0]


def test_narayanan_record_is_model_flops_not_hardware_flops() -> None:
    """Narayanan et al. 2021 report 138 TFLOP/s per A100 for GPT-3 175B on 1,024 GPUs, counting the
    recomputed forward (their appendix's 96·B·s·l·h² form); the record holds the model-FLOPs share
    of it, the ratio of their two closed forms, over the 312 TFLOP/s bf16 peak."""
    s, h, layers, v = 2048, 12288, 96, 51200
    model = 72 * (1 + s / (6 * h) + v / (12 * layers * h))
    hardware = 96 * (1 + s / (6 * h) + v / (16 * layers * h))
    expected = 138e12 * model / hardware / 312e12
    (rec,) = [r for r in PUBLISHED if r.source.startswith("Narayanan")]
    assert rec.mfu == pytest.approx(expected, abs=5e-4)
    assert rec.mfu < 0.44 * 0.76  # the published 44 % is hardware FLOPs utilisation
