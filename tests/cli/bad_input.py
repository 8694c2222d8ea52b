"""What the bad-input tests share: the scratch files with one thing wrong each, the flag sets the
cases reuse, and the check every case runs (tests/cli/test_bad_input*.py).

Each case runs in-process through ``paratrain.cli.main``. ``{tmp}`` in an argument is the scratch
directory holding the files of ``FILES``; ``{file}`` is an existing plain file in it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from paratrain.cli import main
from paratrain.spec.device_presets import DEVICE_PRESETS

H = (
    "# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length,"
    "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)\n"
)

_SCHED = {"name": "1f1b", "stages": 2, "microbatches": 2, "placement": [[0, 1]], "actions": [
    ["F0@c0", "SF0@c0>1", "F1@c0", "SF1@c0>1", "RB0@c0<1", "B0@c0", "RB1@c0<1", "B1@c0", "R@c0", "U"],
    ["RF0@c1<0", "F0@c1", "B0@c1", "SB0@c1>0", "RF1@c1<0", "F1@c1", "B1@c1", "SB1@c1>0", "R@c1", "U"]]}


def _sched(**changes: object) -> str:
    """The 2-stage 1F1B schedule above as JSON, with ``changes`` applied; ``first=ACTION`` puts
    an action before rank 0's list."""
    doc = json.loads(json.dumps(_SCHED))
    first = changes.pop("first", None)
    if first is not None:
        doc["actions"][0].insert(0, first)
    doc.update(changes)
    return json.dumps(doc)


def _trace(source: str, schedule: str = "1f1b", pp: int = 2, mb: int = 4, merge_ranks: bool = False,
           steps: tuple[int, ...] = ()) -> str:
    """A Chrome trace of ``schedule`` (uniform durations) whose metadata says ``source`` wrote it,
    as paratrain train and simulate write theirs; ``merge_ranks`` puts every event under pid 0;
    ``steps``: the timeline once per step, one after the other, each event with its ``args.step``
    (as ``paratrain train --trace`` writes), else once without steps."""
    from paratrain.schedule.registry import generate
    from paratrain.sim import simulate
    from paratrain.trace import chrome_trace

    sched = generate(schedule, stages=pp, microbatches=mb)
    res = simulate(sched, forward=1e-3, backward=2e-3, record=True)
    doc = chrome_trace(res.events)
    if merge_ranks:
        for ev in doc["traceEvents"]:
            ev["pid"] = 0
    if steps:
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        period = max(e["ts"] + e["dur"] for e in spans)
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e["ph"] != "X"] + [
            {**e, "ts": e["ts"] + i * period, "args": {**e.get("args", {}), "step": s}}
            for i, s in enumerate(steps) for e in spans]
    doc["metadata"] = {"source": source, "schedule": schedule, "stages": pp, "microbatches": mb,
                       "iterations": sched.iterations}
    return json.dumps(doc)


_MEASURED = "paratrain train (measured)"
_PREDICTED = "paratrain simulate (predicted)"
RUN = {"parallel": {"dp": 1, "tp": 1, "pp": 2, "microbatch": 1, "global_batch": 8}, "model": "gpt3-1.3b",
        "cluster": "dgx-a100"}

# Spec and data files with one thing wrong each.
FILES = {
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
    "clu_tp_runtime.json": lambda d: '{"preset": "cpu", "tensor_parallel": "deepspeed"}',
    "clu_cores.json": lambda d: '{"preset": "cpu", "cores_per_node": -2}',
    "clu_threads.json": lambda d: '{"preset": "cpu", "cores_per_node": 2, "threads_per_process": 0}',
    "clu_tp_table.json": lambda d: '{"preset": "cpu", "measured_collectives": [["all_reduce", 4, 4096]]}',
    "mod_nan.json": lambda d: '{"preset": "gpt2", "hidden": NaN}',
    "mod_list.json": lambda d: "[1, 2]",
    "mod_ok.json": lambda d: '{"preset": "gpt3-1.3b"}',
    "mod_bad.yaml": lambda d: "layers: [1,\n",
    "hf_tie_text.json": lambda d: json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                              "vocab_size": 100, "tie_word_embeddings": "false"}),
    "hf_bias_text.json": lambda d: json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                               "num_attention_heads": 4, "intermediate_size": 128,
                                               "vocab_size": 100, "attention_bias": "no"}),
    "hf_act_gpt2.json": lambda d: json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                              "vocab_size": 100, "activation_function": "tanh"}),
    "hf_act_bert.json": lambda d: json.dumps({"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
                                              "num_attention_heads": 4, "vocab_size": 100, "hidden_act": "mish"}),
    "hf_act_llama.json": lambda d: json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                               "num_attention_heads": 4, "intermediate_size": 128,
                                               "vocab_size": 100, "hidden_act": "sigmoid"}),
    "hf_act_llama_gelu.json": lambda d: json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                    "num_attention_heads": 4, "intermediate_size": 128,
                                                    "vocab_size": 100, "hidden_act": "gelu"}),
    "hf_gemma2.json": lambda d: json.dumps({"model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2,
                                            "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
                                            "hidden_activation": "gelu_pytorch_tanh"}),
    "nan.csv": lambda d: H + "8,16,2,1024,16,24,1024,2,4,1,nan\n",
    "inf.csv": lambda d: H + "8,16,2,1024,16,24,1024,2,4,1,inf\n",
    "inf_int.csv": lambda d: H + "8,16,2,1024,16,24,1024,2,4,inf,100\n",
    "billion.csv": lambda d: H + "1000000000,1000000000,1,1024,16,24,1024,1,1000000000,1,100\n",
    "ok.csv": lambda d: H + "8,16,2,1024,16,24,1024,2,4,1,100\n",
    "short_row.csv": lambda d: H + "8,16,2,1024,16,24,1024,2,4\n",
    "long_row.csv": lambda d: H + "8,16,2,1024,16,24,1024,2,4,1,100,7\n",
    "text_cell.csv": lambda d: H + "8,16,2,1024,16,24,1024,2,4,1,fast\n",
    "dup_row.csv": lambda d: H + "8,16,2,1024,16,24,1024,2,4,1,100\n" * 2,
    "file.txt": lambda d: "an existing plain file\n",
    # schedules for `schedule show --file`
    "sched_ok.json": lambda d: _sched(),
    "sched_filler_nan.json": lambda d: _sched(first="X:wait/nan"),
    "sched_filler_inf.json": lambda d: _sched(first="X:wait/inf"),
    "sched_filler_negative.json": lambda d: _sched(first="X:wait/-5"),
    "sched_iterations_zero.json": lambda d: _sched(iterations=0),
    "sched_microbatches_null.json": lambda d: _sched(microbatches=None),
    "sched_microbatches_negative.json": lambda d: _sched(microbatches=-2),
    "sched_versions_text.json": lambda d: _sched(weight_versions="x"),
    "sched_stages_float.json": lambda d: _sched(stages=2.5),
    "sched_stages_text.json": lambda d: _sched(stages="2"),
    "sched_placement_float.json": lambda d: _sched(placement=[[0.0, 1.0]]),
    "sched_insert_text.json": lambda d: _sched(insert_p2p="no"),
    "sched_deadlock.json": lambda d: _sched(actions=[
        ["F0@c0", "RB0@c0<1", "B0@c0", "SF0@c0>1", "F1@c0", "SF1@c0>1", "RB1@c0<1", "B1@c0", "R@c0", "U"],
        _SCHED["actions"][1]]),
    # run documents for `simulate --config`
    "run_ok.json": lambda d: json.dumps({"config": RUN}),
    "run_fp8.json": lambda d: json.dumps({"config": {"parallel": {"dp": 2, "microbatch": 1, "global_batch": 8,
                                                                  "gemm_dtype": "fp8"}, "model": "gpt-tiny"}}),
    "run_extra_key.json": lambda d: json.dumps({"config": {**RUN, "schedule": "1f1b"}}),
    "run_config_list.json": lambda d: json.dumps({"config": [1]}),
    "run_powersgd.json": lambda d: json.dumps({"config": {**RUN, "parallel": {**RUN["parallel"], "dp": 2,
                                                                             "compression": "powersgd"}}}),
    "run_cluster_no_device.json": lambda d: json.dumps({"config": {**RUN, "cluster": {
        "name": "c", "nodes": 1, "devices_per_node": 8, "intra_link": {"bandwidth_Bps": 1e11, "latency_s": 1e-6},
        "inter_link": {"bandwidth_Bps": 1e10, "latency_s": 1e-6}}}}),
    "dev_no_peak.json": lambda d: json.dumps({"name": "x"}),
    # traces for `compare` and `calibrate --from-trace`
    "measured.json": lambda d: _trace(_MEASURED),
    "measured_gpipe.json": lambda d: _trace(_MEASURED, "gpipe"),
    "measured_merged.json": lambda d: _trace(_MEASURED, merge_ranks=True),
    "measured_steps.json": lambda d: _trace(_MEASURED, steps=(0, 1, 2)),
    "measured_step_gaps.json": lambda d: _trace(_MEASURED, steps=(0, 2, 5)),
    "measured_pipedream.json": lambda d: _trace(_MEASURED, "pipedream", steps=(0, 1)),
    "predicted_pipedream.json": lambda d: _trace(_PREDICTED, "pipedream"),
    "predicted.json": lambda d: _trace(_PREDICTED),
    "predicted_pp4.json": lambda d: _trace(_PREDICTED, pp=4),
    "calibration.json": lambda d: json.dumps(DEVICE_PRESETS["cpu"].to_dict()),
    "calibration_preset.json": lambda d: json.dumps({"preset": "cpu"}),
}

M = ["--model", "gpt3-1.3b"]
SIM = ["simulate", *M, "--tp", "2", "--pp", "2", "--dp", "2", "--microbatch", "1", "--global-batch", "8"]
PLAN = ["plan", *M, "--gpus", "8", "--global-batch", "64", "--no-simulate"]
SWEEP = [*PLAN, "--sweep", "gpus=8,16"]
BIG = str(2**40)


def write_scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp_path`` holding ``FILES``, made the working directory, with its own calibration cache."""
    for name, make in FILES.items():
        (tmp_path / name).write_text(make(tmp_path), encoding="utf-8")
    # No calibration of this machine leaks into the cases.
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    # A relative path a command writes by mistake lands here, where the check below sees it.
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str, float]:
    """``(exit code, stdout, stderr, seconds)`` of ``paratrain ARGV`` run in this process."""
    t0 = time.monotonic()
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0) if not isinstance(e.code, str) else 1
    elapsed = time.monotonic() - t0
    out = capsys.readouterr()
    return code, out.out, out.err, elapsed


def check_one_line(capsys: pytest.CaptureFixture[str], scratch: Path, argv: list[str], needle: str) -> None:
    """``paratrain ARGV`` ends within 5 s with exit 2 and one error line holding ``needle`` and a
    fix, no traceback, and nothing written to the scratch directory."""
    argv = [a.replace("{tmp}", str(scratch)).replace("{file}", str(scratch / "file.txt")) for a in argv]
    before = sorted(p.name for p in scratch.rglob("*"))
    code, out, err, elapsed = run_cli(capsys, argv)
    lines = err.strip().splitlines()
    assert code == 2, (code, out[-500:], err[-2000:])
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("paratrain: error: ") and "fix:" in lines[0], lines[0]
    assert needle in lines[0], lines[0]
    assert elapsed < 5.0, f"took {elapsed:.1f} s"
    assert sorted(p.name for p in scratch.rglob("*")) == before  # nothing written
