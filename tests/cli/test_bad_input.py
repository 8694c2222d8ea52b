"""Malformed invocations of every command end fast, with exit code 2 and one line that names the
field and the fix: no traceback, no hang, no exit 0 on nonsense, no file written.

Each case runs in-process through ``paratrain.cli.main``. ``{tmp}`` in an argument is a scratch
directory holding the files of ``_FILES``; ``{file}`` is an existing plain file in it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from paratrain.cli import main

H = (
    "# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,"
    "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)\n"
)

# Spec and data files with one thing wrong each.
_FILES = {
    "dev_self.json": lambda d: json.dumps({"preset": str(d / "dev_self.json")}),
    "dev_loop_a.json": lambda d: json.dumps({"preset": str(d / "dev_loop_b.json")}),
    "dev_loop_b.json": lambda d: json.dumps({"preset": str(d / "dev_loop_a.json")}),
    "clu_self.json": lambda d: json.dumps({"preset": str(d / "clu_self.json")}),
    "dev_nan.json": lambda d: '{"preset": "a100", "peak_fp32_flops": NaN}',
    "dev_inf.json": lambda d: '{"preset": "a100", "peak_bf16_flops": Infinity}',
    "dev_neg_eff.json": lambda d: '{"preset": "a100", "gemm_efficiency": -0.5}',
    "dev_reserve.json": lambda d: '{"preset": "a100", "memory_reserved_bytes": 1e15}',
    "clu_nan.json": lambda d: '{"preset": "dgx-a100", "inter_link": {"bandwidth_Bps": NaN, "latency_s": 1e-6}}',
    "clu_topo.json": lambda d: '{"preset": "dgx-a100", "topology": "bogus"}',
    "clu_dev.json": lambda d: '{"preset": "dgx-a100", "device": 42}',
    "clu_link.json": lambda d: '{"preset": "dgx-a100", "intra_link": 5}',
    "clu_nodes.json": lambda d: '{"preset": "dgx-a100", "nodes": 100000000}',
    "clu_list.json": lambda d: "[1, 2]",
    "mod_nan.json": lambda d: '{"preset": "gpt2", "hidden": NaN}',
    "mod_list.json": lambda d: "[1, 2]",
    "mod_bad.yaml": lambda d: "layers: [1,\n",
    "nan.csv": lambda d: H + "8,16,2,1024,16,24,1024,2,4,1,nan\n",
    "inf.csv": lambda d: H + "8,16,2,1024,16,24,1024,2,4,1,inf\n",
    "inf_int.csv": lambda d: H + "8,16,2,1024,16,24,1024,2,4,inf,100\n",
    "billion.csv": lambda d: H + "1000000000,1000000000,1,1024,16,24,1024,1,1000000000,1,100\n",
    "ok.csv": lambda d: H + "8,16,2,1024,16,24,1024,2,4,1,100\n",
    "file.txt": lambda d: "an existing plain file\n",
}

M = ["--model", "gpt3-1.3b"]
SIM = ["simulate", *M, "--tp", "2", "--pp", "2", "--dp", "2", "--microbatch", "1", "--global-batch", "8"]
PLAN = ["plan", *M, "--gpus", "8", "--global-batch", "64", "--no-simulate"]
SWEEP = [*PLAN, "--sweep", "gpus=8,16"]
BIG = str(2**40)

# (id, argv, text the one error line must contain)
CASES = [
    # presets
    ("presets-extra-arg", ["presets", "extra"], "unexpected extra argument"),
    ("presets-unknown-flag", ["presets", "--wide"], "--wide"),
    # cost
    ("cost-vocab-huge", ["cost", *M, "--vocab", "100000000000"], "vocab"),
    ("cost-vocab-float", ["cost", *M, "--vocab", "1e23"], "--vocab"),
    ("cost-hidden-huge", ["cost", *M, "--hidden", BIG, "--heads", "1"], "hidden"),
    ("cost-seq-huge", ["cost", *M, "--seq", BIG], "seq"),
    ("cost-layers-huge", ["cost", *M, "--layers", "1000000000000"], "layers"),
    ("cost-microbatch-huge", ["cost", *M, "--microbatch", str(10**15)], "microbatch"),
    ("cost-tp-zero", ["cost", *M, "--tp", "0"], "--tp"),
    ("cost-dtype", ["cost", *M, "--dtype", "fp7"], "--dtype"),
    ("cost-device-nan", ["cost", *M, "--device", "{tmp}/dev_nan.json"], "peak_fp32_flops"),
    ("cost-device-inf", ["cost", *M, "--device", "{tmp}/dev_inf.json"], "peak_bf16_flops"),
    ("cost-device-negative", ["cost", *M, "--device", "{tmp}/dev_neg_eff.json"], "gemm_efficiency"),
    ("cost-device-reserve", ["cost", *M, "--device", "{tmp}/dev_reserve.json"], "memory_reserved_bytes"),
    ("cost-device-self-preset", ["cost", *M, "--device", "{tmp}/dev_self.json"], "preset chain loops"),
    ("cost-device-preset-loop", ["cost", *M, "--device", "{tmp}/dev_loop_a.json"], "preset chain loops"),
    ("cost-device-directory", ["cost", *M, "--device", "{tmp}"], "is a directory"),
    ("cost-device-missing", ["cost", *M, "--device", "{tmp}/missing.json"], "does not exist"),
    ("cost-model-directory", ["cost", "--model", "{tmp}"], "is a directory"),
    ("cost-model-nan", ["cost", "--model", "{tmp}/mod_nan.json"], "hidden"),
    ("cost-model-list", ["cost", "--model", "{tmp}/mod_list.json"], "mapping"),
    ("cost-model-bad-yaml", ["cost", "--model", "{tmp}/mod_bad.yaml"], "malformed"),
    ("cost-cluster-nan-link", ["cost", *M, "--cluster", "{tmp}/clu_nan.json"], "bandwidth_Bps"),
    ("cost-cluster-self-preset", ["cost", *M, "--cluster", "{tmp}/clu_self.json"], "preset chain loops"),
    ("cost-cluster-topology", ["cost", *M, "--cluster", "{tmp}/clu_topo.json"], "topology"),
    ("cost-cluster-device-int", ["cost", *M, "--cluster", "{tmp}/clu_dev.json"], "device"),
    ("cost-cluster-link-int", ["cost", *M, "--cluster", "{tmp}/clu_link.json"], "intra_link"),
    ("cost-cluster-nodes-huge", ["cost", *M, "--cluster", "{tmp}/clu_nodes.json"], "exceed the limit"),
    ("cost-cluster-list", ["cost", *M, "--cluster", "{tmp}/clu_list.json"], "mapping"),
    # simulate
    ("simulate-gpus-huge", ["simulate", *M, "--gpus", "1000000000"], "limit"),
    ("simulate-batch-huge", [*SIM[:-2], "--global-batch", "1000000000"], "limit"),
    ("simulate-samples-huge", [*SIM, "--duration-cv", "0.1", "--samples", "1000000000"], "--samples"),
    ("simulate-cv-nan", [*SIM, "--duration-cv", "nan"], "--duration-cv"),
    ("simulate-hidden-huge", [*SIM, "--hidden", BIG], "hidden"),
    ("simulate-pp-huge", ["simulate", *M, "--pp", "1000000000"], "limit"),
    ("simulate-plot-directory", [*SIM, "--plot", "{tmp}"], "--plot"),
    ("simulate-plot-under-file", [*SIM, "--plot", "{file}/x.png"], "--plot"),
    ("simulate-trace-directory", [*SIM, "--trace", "{tmp}"], "--trace"),
    ("simulate-trace-under-file", [*SIM, "--trace", "{file}/x.json"], "--trace"),
    ("simulate-config-directory", ["simulate", "--config", "{tmp}"], "is a directory"),
    ("simulate-cluster-nan", [*SIM, "--cluster", "{tmp}/clu_nan.json"], "bandwidth_Bps"),
    # plan
    ("plan-memory-limit-nan", [*PLAN, "--memory-limit", "nan"], "--memory-limit"),
    ("plan-memory-limit-inf", [*PLAN, "--memory-limit", "inf"], "--memory-limit"),
    ("plan-memory-limit-negative", [*PLAN, "--memory-limit", "-1"], "--memory-limit"),
    ("plan-output-directory", [*PLAN, "-o", "{tmp}"], "--output"),
    ("plan-output-under-file", [*PLAN, "-o", "{file}/x.json"], "--output"),
    ("plan-gpus-huge", ["plan", *M, "--gpus", "1000000000", "--global-batch", "64"], "--gpus"),
    ("plan-nodes-huge", ["plan", *M, "--nodes", "1000000000", "--global-batch", "64"], "--nodes"),
    ("plan-batch-huge", ["plan", *M, "--gpus", "8", "--global-batch", "1000000000"], "limit"),
    ("plan-hidden-huge", [*PLAN, "--hidden", BIG], "hidden"),
    ("plan-device-nan", [*PLAN, "--device", "{tmp}/dev_nan.json"], "peak_fp32_flops"),
    # plan --sweep
    ("sweep-plot-directory", [*SWEEP, "--plot", "{tmp}"], "--plot"),
    ("sweep-table-directory", [*SWEEP, "--table", "{tmp}"], "--table"),
    ("sweep-table-under-file", [*SWEEP, "--table", "{file}/x.csv"], "--table"),
    ("sweep-gpus-huge", [*PLAN, "--sweep", "gpus=8,1000000000"], "--sweep"),
    ("sweep-seq-huge", [*PLAN, "--sweep", "seq=1000000000000"], "--sweep"),
    ("sweep-batch-huge", [*PLAN, "--sweep", "batch=1000000000"], "--sweep"),
    ("sweep-not-integers", [*PLAN, "--sweep", "gpus=a"], "sweep"),
    ("sweep-unknown-variable", [*PLAN, "--sweep", "foo=1"], "sweep"),
    # validate
    ("validate-nan-time", ["validate", "{tmp}/nan.csv"], "not a finite number"),
    ("validate-inf-time", ["validate", "{tmp}/inf.csv"], "not a finite number"),
    ("validate-inf-count", ["validate", "{tmp}/inf_int.csv"], "not a finite number"),
    ("validate-billion-gpus", ["validate", "{tmp}/billion.csv"], "line 2"),
    ("validate-rows-negative", ["validate", "{tmp}/ok.csv", "--rows", "-1"], "--rows"),
    ("validate-directory", ["validate", "{tmp}"], "is a directory"),
    ("validate-missing", ["validate", "{tmp}/missing.csv"], "does not exist"),
    ("validate-plot-directory", ["validate", "{tmp}/ok.csv", "--plot", "{tmp}"], "--plot"),
    ("validate-plot-under-file", ["validate", "{tmp}/ok.csv", "--plot", "{file}/x.png"], "--plot"),
    ("validate-engine", ["validate", "{tmp}/ok.csv", "--engine", "x"], "--engine"),
    ("validate-calibration", ["validate", "{tmp}/ok.csv", "--calibration", "x"], "--calibration"),
    ("validate-evaluations-zero", ["validate", "{tmp}/ok.csv", "--fit", "--evaluations", "0"], "--evaluations"),
    ("validate-evaluations-huge", ["validate", "{tmp}/ok.csv", "--fit", "--evaluations", str(10**9)], "--evaluations"),
    ("validate-lut-file", ["validate", "{tmp}/ok.csv", "--fit", "--lut", "{tmp}/ok.csv"], "--lut"),
    ("validate-lut-without-fit", ["validate", "{tmp}/ok.csv", "--lut", "{tmp}"], "--lut"),
    ("validate-plot-with-fit", ["validate", "{tmp}/ok.csv", "--fit", "--plot", "{tmp}/x.png"], "--plot"),
    # advise-shape
    ("advise-tp-zero", ["advise-shape", *M, "--tp", "0"], "tp"),
    ("advise-microbatch-zero", ["advise-shape", *M, "--microbatch", "0"], "microbatch"),
    ("advise-microbatch-huge", ["advise-shape", *M, "--microbatch", str(10**12)], "microbatch"),
    ("advise-hidden-huge", ["advise-shape", *M, "--hidden", BIG], "hidden"),
    # demo: every argument is checked before the first step
    ("demo-steps-zero", ["demo", "--steps", "0", "--out", "{tmp}/demo"], "--steps"),
    ("demo-steps-huge", ["demo", "--steps", str(10**12), "--out", "{tmp}/demo"], "--steps"),
    ("demo-out-file", ["demo", "--out", "{file}"], "--out"),
    ("demo-out-under-file", ["demo", "--out", "{file}/sub"], "--out"),
    ("demo-gpus-zero", ["demo", "--gpus", "0", "--out", "{tmp}/demo"], "--gpus"),
    ("demo-gpus-odd", ["demo", "--gpus", "12", "--out", "{tmp}/demo"], "--gpus"),
    ("demo-batch-negative", ["demo", "--global-batch", "-1", "--out", "{tmp}/demo"], "--global-batch"),
    ("demo-model-unknown", ["demo", "--model", "nope", "--out", "{tmp}/demo"], "--model"),
]


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    for name, make in _FILES.items():
        (tmp_path / name).write_text(make(tmp_path), encoding="utf-8")
    # No calibration of this machine leaks into the cases.
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _run(capsys, argv: list[str]) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0) if not isinstance(e.code, str) else 1
    elapsed = time.monotonic() - t0
    out = capsys.readouterr()
    return code, out.out, out.err, elapsed


@pytest.mark.parametrize("argv, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2(capsys, scratch, argv, needle):
    argv = [a.replace("{tmp}", str(scratch)).replace("{file}", str(scratch / "file.txt")) for a in argv]
    before = sorted(p.name for p in scratch.rglob("*"))
    code, out, err, elapsed = _run(capsys, argv)
    lines = err.strip().splitlines()
    assert code == 2, (code, out[-500:], err[-2000:])
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("paratrain: error: ") and "fix:" in lines[0], lines[0]
    assert needle in lines[0], lines[0]
    assert elapsed < 5.0, f"took {elapsed:.1f} s"
    assert sorted(p.name for p in scratch.rglob("*")) == before  # nothing written


@pytest.mark.parametrize("content", ["[1, 2]", "null", "{not json", '{"peak_fp32_flops": NaN}', '{"preset": "cpu"}'])
def test_damaged_calibration_cache_falls_back(capsys, tmp_path, monkeypatch, content):
    """A calibration file that is not a device (list, null, garbage, NaN, a preset loop) is ignored:
    the uncalibrated ``cpu`` preset is used, as when nothing was measured."""
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    (tmp_path / "cpu.json").write_text(content)
    (tmp_path / "cpu-cluster.json").write_text(content)
    code, out, err, _ = _run(capsys, ["cost", "--model", "gpt-tiny", "--device", "cpu", "--json"])
    assert code == 0, err
    assert json.loads(out)["device"] == "cpu"
    from paratrain.spec.cluster import resolve_cluster
    from paratrain.spec.device_presets import DEVICE_PRESETS

    assert resolve_cluster("cpu").device == DEVICE_PRESETS["cpu"]
