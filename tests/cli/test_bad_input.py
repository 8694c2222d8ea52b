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


def _trace(source: str, schedule: str = "1f1b", pp: int = 2, mb: int = 4, merge_ranks: bool = False) -> str:
    """A Chrome trace of ``schedule`` (uniform durations) whose metadata says ``source`` wrote it,
    as paratrain train and simulate write theirs; ``merge_ranks`` puts every event under pid 0."""
    from paratrain.schedule.registry import generate
    from paratrain.sim import simulate
    from paratrain.trace import chrome_trace

    res = simulate(generate(schedule, stages=pp, microbatches=mb), forward=1e-3, backward=2e-3, record=True)
    doc = chrome_trace(res.events)
    if merge_ranks:
        for ev in doc["traceEvents"]:
            ev["pid"] = 0
    doc["metadata"] = {"source": source, "schedule": schedule, "stages": pp, "microbatches": mb, "iterations": 1}
    return json.dumps(doc)


_MEASURED = "paratrain train (measured)"
_PREDICTED = "paratrain simulate (predicted)"
_RUN = {"parallel": {"dp": 1, "tp": 1, "pp": 2, "microbatch": 1, "global_batch": 8}, "model": "gpt3-1.3b",
        "cluster": "dgx-a100"}

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
    "run_ok.json": lambda d: json.dumps({"config": _RUN}),
    "run_extra_key.json": lambda d: json.dumps({"config": {**_RUN, "schedule": "1f1b"}}),
    "run_config_list.json": lambda d: json.dumps({"config": [1]}),
    "run_cluster_no_device.json": lambda d: json.dumps({"config": {**_RUN, "cluster": {
        "name": "c", "nodes": 1, "devices_per_node": 8, "intra_link": {"bandwidth_Bps": 1e11, "latency_s": 1e-6},
        "inter_link": {"bandwidth_Bps": 1e10, "latency_s": 1e-6}}}}),
    "dev_no_peak.json": lambda d: json.dumps({"name": "x"}),
    # traces for `compare` and `calibrate --from-trace`
    "measured.json": lambda d: _trace(_MEASURED),
    "measured_gpipe.json": lambda d: _trace(_MEASURED, "gpipe"),
    "measured_merged.json": lambda d: _trace(_MEASURED, merge_ranks=True),
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
    ("cost-hf-tie-text", ["cost", "--model", "{tmp}/hf_tie_text.json"], "tie_word_embeddings"),
    ("cost-hf-bias-text", ["cost", "--model", "{tmp}/hf_bias_text.json"], "attention_bias"),
    # an activation paratrain does not model is refused, not priced as tanh-GELU
    ("cost-hf-act-gpt2", ["cost", "--model", "{tmp}/hf_act_gpt2.json"], "'activation_function': unknown activation"),
    ("cost-hf-act-bert", ["cost", "--model", "{tmp}/hf_act_bert.json"], "'hidden_act': unknown activation 'mish'"),
    ("cost-hf-act-llama", ["cost", "--model", "{tmp}/hf_act_llama.json"], "use one of: silu, swish, swiglu, gelu"),
    ("cost-model-bad-yaml", ["cost", "--model", "{tmp}/mod_bad.yaml"], "malformed"),
    ("cost-cluster-nan-link", ["cost", *M, "--cluster", "{tmp}/clu_nan.json"], "bandwidth_Bps"),
    ("cost-cluster-self-preset", ["cost", *M, "--cluster", "{tmp}/clu_self.json"], "preset chain loops"),
    ("cost-cluster-topology", ["cost", *M, "--cluster", "{tmp}/clu_topo.json"], "topology"),
    ("cost-cluster-device-int", ["cost", *M, "--cluster", "{tmp}/clu_dev.json"], "device"),
    ("cost-cluster-link-int", ["cost", *M, "--cluster", "{tmp}/clu_link.json"], "intra_link"),
    ("cost-cluster-nodes-huge", ["cost", *M, "--cluster", "{tmp}/clu_nodes.json"], "exceed the limit"),
    ("cost-cluster-list", ["cost", *M, "--cluster", "{tmp}/clu_list.json"], "mapping"),
    ("cost-cluster-tp-runtime", ["cost", *M, "--cluster", "{tmp}/clu_tp_runtime.json"], "tensor_parallel"),
    ("cost-cluster-cores", ["cost", *M, "--cluster", "{tmp}/clu_cores.json"], "cores_per_node"),
    ("cost-cluster-threads", ["cost", *M, "--cluster", "{tmp}/clu_threads.json"], "threads_per_process"),
    ("cost-cluster-tp-table", ["cost", *M, "--cluster", "{tmp}/clu_tp_table.json"], "measured_collectives[0]"),
    # simulate
    ("simulate-fp8-on-a100", [*SIM, "--gemm-dtype", "fp8"], "--gemm-dtype: a100-80gb has no FP8"),
    ("simulate-gemm-dtype-unknown", [*SIM, "--gemm-dtype", "fp4"], "--gemm-dtype: unknown GEMM dtype"),
    ("plan-fp8-on-a100", [*PLAN, "--gemm-dtype", "fp8"], "--gemm-dtype"),
    ("plan-measured-on-cpu", [*PLAN, "-d", "cpu", "--calibration", "measured"], "no bf16 tensor cores"),
    ("calibrate-measured-missing", [*SIM, "--calibration", "measured"], "calibrate --gpu a100-80gb"),
    ("simulate-gpus-huge", ["simulate", *M, "--gpus", "1000000000"], "limit"),
    ("simulate-batch-huge", [*SIM[:-2], "--global-batch", "1000000000"], "limit"),
    ("simulate-samples-huge", [*SIM, "--duration-cv", "0.1", "--samples", "1000000000"], "--samples"),
    ("simulate-cv-nan", [*SIM, "--duration-cv", "nan"], "--duration-cv"),
    ("simulate-samples-too-much-work", ["simulate", "--model", "gpt3-175b", "--gpus", "1024", "--tp", "8", "--pp", "16",
                                       "--global-batch", "16384", "--microbatch", "1", "--duration-cv", "0.1"],
     "--samples 5 or fewer"),
    ("simulate-hidden-huge", [*SIM, "--hidden", BIG], "hidden"),
    ("simulate-pp-huge", ["simulate", *M, "--pp", "1000000000"], "limit"),
    ("simulate-plot-directory", [*SIM, "--plot", "{tmp}"], "--plot"),
    ("simulate-plot-under-file", [*SIM, "--plot", "{file}/x.png"], "--plot"),
    ("simulate-trace-directory", [*SIM, "--trace", "{tmp}"], "--trace"),
    ("simulate-trace-under-file", [*SIM, "--trace", "{file}/x.json"], "--trace"),
    ("simulate-config-directory", ["simulate", "--config", "{tmp}"], "is a directory"),
    ("simulate-cluster-nan", [*SIM, "--cluster", "{tmp}/clu_nan.json"], "bandwidth_Bps"),
    # flags that act only with another one, given without it (the default spelled out included)
    ("simulate-kfac-inversion-without-fill", [*SIM, "--kfac-inversion", "inverse"], "--kfac-inversion"),
    ("simulate-comm-log-without-json", [*SIM, "--comm-log"], "--comm-log"),
    ("simulate-density-without-compress", [*SIM, "--density", "0.01"], "--density: sets the fraction"),
    ("simulate-density-config-without-compress", ["simulate", "--config", "{tmp}/run_ok.json", "--density", "0.1"],
     "--density: sets the fraction"),
    ("simulate-attention-unknown", [*SIM, "--attention", "sdpa"], "--attention: unknown attention"),
    # an upper-case choice is read as the lower-case one, as --schedule's and --recompute's are
    ("simulate-attention-upper-math-cp", [*SIM[:-2], "--global-batch", "4", "--dp", "1", "--cp", "2",
                                          "--attention", "MATH"], "--cp"),
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
    ("validate-sources-engine-unknown", ["validate", "public-runs", "--engine", "bogus"], "--engine: unknown"),
    ("validate-sources-engine-sim", ["validate", "public-runs", "--engine", "sim"], "closed forms"),
    ("validate-fit-engine-sim", ["validate", "{tmp}/ok.csv", "--fit", "--engine", "sim"], "closed forms"),
    ("validate-sources-cluster", ["validate", "public-runs", "--cluster", "nope"], "--cluster"),
    ("validate-evaluations-without-fit", ["validate", "{tmp}/ok.csv", "--evaluations", "5"], "--evaluations"),
    ("validate-sources-evaluations-alone", ["validate", "all", "--evaluations", "5"], "--evaluations"),
    ("validate-calibration-empty", ["validate", "{tmp}/ok.csv", "--calibration", ""], "--calibration"),
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
    # schedule show --file: wrong types, impossible counts, a deadlock
    ("sched-filler-nan", ["schedule", "show", "-f", "{tmp}/sched_filler_nan.json"], "filler duration"),
    ("sched-filler-inf", ["schedule", "show", "-f", "{tmp}/sched_filler_inf.json"], "filler duration"),
    ("sched-filler-negative", ["schedule", "show", "-f", "{tmp}/sched_filler_negative.json"], "filler duration"),
    ("sched-iterations-zero", ["schedule", "show", "-f", "{tmp}/sched_iterations_zero.json"], "--file.iterations"),
    ("sched-microbatches-null", ["schedule", "show", "-f", "{tmp}/sched_microbatches_null.json"],
     "--file.microbatches"),
    ("sched-microbatches-negative", ["schedule", "show", "-f", "{tmp}/sched_microbatches_negative.json"],
     "--file.microbatches"),
    ("sched-versions-text", ["schedule", "show", "-f", "{tmp}/sched_versions_text.json"], "--file.weight_versions"),
    ("sched-stages-float", ["schedule", "show", "-f", "{tmp}/sched_stages_float.json"], "--file.stages"),
    ("sched-stages-text", ["schedule", "show", "-f", "{tmp}/sched_stages_text.json"], "--file.stages"),
    ("sched-placement-float", ["schedule", "show", "-f", "{tmp}/sched_placement_float.json"], "--file.placement"),
    ("sched-insert-p2p-text", ["schedule", "show", "-f", "{tmp}/sched_insert_text.json"], "--file.insert_p2p"),
    ("sched-deadlock", ["schedule", "show", "-f", "{tmp}/sched_deadlock.json"], "deadlock"),
    ("sched-save-over-file", ["schedule", "show", "-f", "{tmp}/sched_ok.json", "--save", "{tmp}/sched_ok.json"],
     "--file input"),
    ("sched-plot-over-file", ["schedule", "show", "-f", "{tmp}/sched_ok.json", "--plot", "{tmp}/sched_ok.json"],
     "--file input"),
    ("sched-plot-trace-same", ["schedule", "show", "-s", "1f1b", "--plot", "{tmp}/x", "--trace", "{tmp}/x"],
     "--plot file"),
    ("sched-file-with-stages", ["schedule", "show", "-f", "{tmp}/sched_ok.json", "--stages", "8"], "--stages"),
    ("sched-save-name-too-long", ["schedule", "show", "-s", "1f1b", "--save", "{tmp}/" + "a" * 300 + ".json"],
     "more than 255"),
    ("sched-save-folder-name-too-long", ["schedule", "show", "-s", "1f1b", "--save",
                                         "{tmp}/new/" + "b" * 300 + "/x.json"], "more than 255"),
    ("sched-forward-inf", ["schedule", "show", "-s", "1f1b", "--forward-time", "inf"], "--forward-time"),
    ("sched-unknown", ["schedule", "show", "-s", "bogus"], "--schedule"),
    ("sched-backward-huge", ["schedule", "show", "-s", "1f1b", "--backward-time", "1e308"], "--backward-time"),
    ("sched-forward-subnormal", ["schedule", "show", "-s", "1f1b", "--forward-time", "1e-320"], "--forward-time"),
    ("sched-fill-forward-huge", ["schedule", "show", "-s", "1f1b", "--fill", "kfac", "--forward-time", "1e300"],
     "--forward-time"),
    ("sched-iterations-flag-zero", ["schedule", "show", "-s", "pipedream", "--iterations", "0"], "--iterations"),
    # simulate: outputs on one path or on an input; run documents malformed or of another kind
    ("simulate-trace-plot-same", [*SIM, "--trace", "{tmp}/x", "--plot", "{tmp}/x"], "--trace file"),
    ("simulate-trace-over-config", ["simulate", "--config", "{tmp}/run_ok.json", "--trace", "{tmp}/run_ok.json"],
     "--config input"),
    ("simulate-config-extra-key", ["simulate", "--config", "{tmp}/run_extra_key.json"], "'schedule'"),
    ("simulate-config-not-mapping", ["simulate", "--config", "{tmp}/run_config_list.json"], "must be a mapping"),
    ("simulate-config-is-schedule", ["simulate", "--config", "{tmp}/sched_ok.json"], "looks like a pipeline schedule"),
    ("simulate-config-is-trace", ["simulate", "--config", "{tmp}/measured.json"], "looks like a Chrome trace"),
    ("simulate-config-no-device", ["simulate", "--config", "{tmp}/run_cluster_no_device.json"],
     "'device': is required"),
    ("cost-model-is-trace", ["cost", "--model", "{tmp}/measured.json"], "looks like a Chrome trace"),
    ("cost-device-no-peak", ["cost", *M, "--device", "{tmp}/dev_no_peak.json"], "is required"),
    # plan: contradicting pins, limits past the device, outputs over inputs
    ("plan-pins-product", [*PLAN, "--tp", "2", "--pp", "2", "--dp", "4"], "= 16"),
    ("plan-pins-product-two", [*PLAN, "--tp", "4", "--pp", "4"], "= 16"),
    ("plan-schedule-not-in-schedules", [*PLAN, "--schedule", "1f1b", "--schedules", "gpipe"], "--schedule"),
    ("plan-memory-limit-above-device", [*PLAN, "--memory-limit", "81"], "--memory-limit"),
    ("plan-output-over-model", [*PLAN[:1], "--model", "{tmp}/mod_ok.json", *PLAN[3:], "-o", "{tmp}/mod_ok.json"],
     "--model input"),
    ("sweep-plot-table-same", [*SWEEP, "--plot", "{tmp}/x", "--table", "{tmp}/x"], "--plot file"),
    ("plan-confirm-without-simulator", [*PLAN, "--confirm", "5"], "--confirm"),
    ("plan-plot-without-sweep", [*PLAN, "--plot", "{tmp}/x.png"], "--plot"),
    ("plan-table-without-sweep", [*PLAN, "--table", "{tmp}/x.csv"], "--table"),
    ("sweep-output", [*SWEEP, "-o", "{tmp}/run.json"], "--output"),
    ("sweep-advise-shape", [*SWEEP, "--advise-shape"], "--advise-shape"),
    ("plan-tp-zero", [*PLAN, "--tp", "0"], "--tp: must be positive"),
    ("plan-pp-zero", [*PLAN, "--pp", "0"], "--pp: must be positive"),
    ("plan-dp-zero", [*PLAN, "--dp", "0"], "--dp: must be positive"),
    ("plan-dp-negative", [*PLAN, "--dp", "-2"], "--dp: must be positive"),
    ("plan-microbatch-zero", [*PLAN, "--microbatch", "0"], "--microbatch: must be positive"),
    ("plan-virtual-stages-negative", [*PLAN, "--virtual-stages", "-1"], "--virtual-stages: must be positive"),
    ("sweep-tp-zero", [*SWEEP, "--tp", "0"], "--tp: must be positive"),
    ("plan-microbatches-over-limit", ["plan", *M, "--gpus", "1", "--global-batch", str(2**24), "--no-simulate"],
     "limit of 16,384"),
    # validate: rows that do not fit the header, text, duplicates, the plot over the data
    ("validate-short-row", ["validate", "{tmp}/short_row.csv"], "has 9 fields"),
    ("validate-long-row", ["validate", "{tmp}/long_row.csv"], "has 12 fields"),
    ("validate-text-cell", ["validate", "{tmp}/text_cell.csv"], "time_ms is 'fast'"),
    ("validate-duplicate-row", ["validate", "{tmp}/dup_row.csv"], "repeats line 2"),
    ("validate-plot-over-data", ["validate", "{tmp}/ok.csv", "--plot", "{tmp}/ok.csv"], "DATA input"),
    # compare: the roles swapped, traces of different runs, ranks merged, the plot over an input
    ("compare-measured-is-simulated", ["compare", "{tmp}/predicted.json", "{tmp}/predicted.json"],
     "MEASURED: "),
    ("compare-simulated-is-measured", ["compare", "{tmp}/measured.json", "{tmp}/measured.json"], "SIMULATED: "),
    ("compare-other-schedule", ["compare", "{tmp}/measured_gpipe.json", "{tmp}/predicted.json"], "schedule"),
    ("compare-other-stages", ["compare", "{tmp}/measured.json", "{tmp}/predicted_pp4.json"], "pipeline stages"),
    ("compare-ranks-merged", ["compare", "{tmp}/measured_merged.json", "{tmp}/predicted.json"], "overlap"),
    ("compare-plot-over-input", ["compare", "{tmp}/measured.json", "{tmp}/predicted.json", "--plot",
                                 "{tmp}/measured.json"], "MEASURED input"),
    # calibrate --from-trace
    ("calibrate-simulated-trace", ["calibrate", "--from-trace", "{tmp}/predicted.json", "--out",
                                   "{tmp}/calibration.json"], "simulated trace"),
    ("calibrate-out-over-trace", ["calibrate", "--from-trace", "{tmp}/measured.json", "--out",
                                  "{tmp}/measured.json"], "--from-trace input"),
    ("calibrate-preset-as-calibration", ["calibrate", "--from-trace", "{tmp}/measured.json", "--out",
                                         "{tmp}/calibration_preset.json"], "not a preset"),
    ("calibrate-threads-with-trace", ["calibrate", "--from-trace", "{tmp}/measured.json", "--threads", "2"],
     "--threads"),
    # an empty value is a malformed flag, not a request for the default
    ("cost-dtype-empty", ["cost", *M, "--dtype", ""], "--dtype"),
    ("cost-cluster-empty", ["cost", *M, "--cluster", ""], "--cluster"),
    ("simulate-cluster-empty", [*SIM, "--cluster", ""], "--cluster"),
    ("plan-tp-overlap-empty", [*PLAN, "--tp-overlap", ""], "--tp-overlap"),
    ("train-model-empty", ["train", "--model", "", "--steps", "1"], "--model"),
    ("cluster-predict-empty", ["cluster", "simulate", "--jobs", "gavel:max_min_fairness.trace", "--predict", ""],
     "--predict"),
    # comm characterize: the plot over an input, a degree beside --layout
    ("comm-plot-over-config", ["comm", "characterize", "--config", "{tmp}/run_ok.json", "--plot",
                               "{tmp}/run_ok.json"], "--config input"),
    ("comm-plot-over-comm-log", ["comm", "characterize", "--comm-log", "{file}", "--plot", "{file}"],
     "--comm-log input"),
    ("comm-layout-with-tp", ["comm", "characterize", *M, "--gpus", "8", "-b", "64", "--layout", "8x1x1", "--tp", "2"],
     "--tp: is set by each --layout"),
    # cluster: outputs over inputs, absurd accelerator counts
    ("cluster-plot-over-jobs", ["cluster", "simulate", "--jobs", "{file}", "--plot", "{file}"], "--jobs input"),
    ("cluster-plot-over-prices", ["cluster", "simulate", "--jobs", "gavel:max_min_fairness.trace", "--prices",
                                  "{file}", "--plot", "{file}"], "--prices input"),
    ("cluster-trace-over-throughputs", ["cluster", "generate-trace", "-o", "{file}", "--throughputs", "{file}"],
     "--throughputs input"),
    ("cluster-accelerators-huge", ["cluster", "simulate", "--jobs", "gavel:max_min_fairness.trace",
                                   "--accelerators", "v100=1000000000000"], "--accelerators"),
    ("cluster-accelerators-sum-huge", ["cluster", "solve", "--jobs", "gavel:max_min_fairness.trace",
                                       "--accelerators", "v100=600000,k80=600000"], "accelerators in all"),
    # arrivals so rare that their times would run to 1e300 s
    ("cluster-trace-rate-tiny", ["cluster", "generate-trace", "-o", "{tmp}/t.trace", "--rate", "1e-300"],
     "--rate: 1e-300 jobs per hour is below the minimum"),
    # rounds so short that the trace needs more than the simulator's limit: refused before the first
    ("cluster-round-s-tiny", ["cluster", "simulate", "--jobs", "gavel:max_min_fairness.trace", "--round-s", "1e-9"],
     "--round-s: the trace needs at least"),
    ("cluster-compare-round-s-tiny", ["cluster", "compare", "--jobs", "gavel:max_min_fairness.trace", "--policies",
                                      "fifo", "--round-s", "1e-9"], "--round-s: the trace needs at least"),
    ("cluster-clouds-empty", ["cluster", "simulate", "--jobs", "gavel:max_min_fairness.trace", "--clouds", ""],
     "--clouds"),
    # a directory given for an input file is named as such, not as missing
    ("cluster-jobs-directory", ["cluster", "simulate", "--jobs", "{tmp}"], "is a directory"),
    ("comm-log-directory", ["comm", "characterize", "--comm-log", "{tmp}"], "is a directory"),
    ("calibrate-comm-table-directory", ["calibrate", "--comm-table", "{tmp}", "--out", "{tmp}/cal.json"],
     "is a directory"),
    # a device given as an input file: reading it whole would never end
    ("compare-device-input", ["compare", "/dev/zero", "{tmp}/predicted.json"], "not a regular file"),
    ("plot-device-input", ["plot", "/dev/zero", "--out", "{tmp}/c.png"], "not a regular file"),
    ("data-whatif-device-input", ["data", "whatif", "--from", "/dev/zero"], "not a regular file"),
    ("calibrate-trace-device-input", ["calibrate", "--from-trace", "/dev/zero", "--out", "{tmp}/calibration.json"],
     "not a regular file"),
    ("cluster-prices-device-input", ["cluster", "simulate", "--jobs", "gavel:max_min_fairness.trace", "--prices",
                                     "/dev/zero"], "not a regular file"),
    ("cost-model-device-input", ["cost", "--model", "/dev/zero"], "--model: '/dev/zero' is not a regular file"),
    ("cost-device-device-input", ["cost", *M, "--device", "/dev/zero"], "--device: '/dev/zero' is not a regular"),
    ("cost-cluster-device-input", ["cost", *M, "--cluster", "/dev/zero"], "--cluster: '/dev/zero' is not a regular"),
    ("simulate-config-device-input", ["simulate", "--config", "/dev/zero"], "--config: '/dev/zero' is not a regular"),
    ("plan-model-device-input", ["plan", "--model", "/dev/zero", "--gpus", "8", "-b", "8"], "not a regular file"),
    ("schedule-file-device-input", ["schedule", "show", "-f", "/dev/zero"], "--file: '/dev/zero' is not a regular"),
    ("validate-device-input", ["validate", "/dev/zero"], "DATA: '/dev/zero' is not a regular file"),
    ("cluster-jobs-device-input", ["cluster", "simulate", "--jobs", "/dev/zero"], "--jobs: '/dev/zero' is not a"),
    ("comm-log-device-input", ["comm", "characterize", "--comm-log", "/dev/zero"], "not a regular file"),
    ("calibrate-comm-table-device-input", ["calibrate", "--comm-table", "/dev/zero", "--out", "{tmp}/cal.json"],
     "--comm-table: '/dev/zero' is not a regular file"),
    ("data-tokenizer-device-input", ["data", "tokenizer", "/dev/zero", "--out", "{tmp}/tok"],
     "'/dev/zero' is not a regular file"),
    # calibrate: counts past any machine, flags the other modes ignore (nothing is measured)
    ("calibrate-procs-huge", ["calibrate", "--procs", BIG, "--out", "{tmp}/cal.json"], "--procs"),
    ("calibrate-threads-huge", ["calibrate", "--procs", "1", "--threads", BIG, "--out", "{tmp}/cal.json"],
     "--threads"),
    ("calibrate-procs-with-gpu", ["calibrate", "--gpu", "h100", "--procs", "4"], "--procs"),
    ("calibrate-procs-with-trace", ["calibrate", "--from-trace", "{tmp}/measured.json", "--procs", "4"], "--procs"),
    ("calibrate-procs-with-comm-table", ["calibrate", "--comm-table", "{file}", "--procs", "4"], "--procs"),
    # comm tune: checked before any process starts
    ("comm-tune-warmup-negative", ["comm", "tune", "-o", "{tmp}/t.json", "--warmup", "-1"], "--warmup"),
    ("comm-tune-warmup-huge", ["comm", "tune", "-o", "{tmp}/t.json", "--warmup", str(10**9)], "--warmup"),
    # flags the chosen size list ignores (--nproc 1: the old code refused that before starting anything)
    ("comm-tune-quick-max-bytes", ["comm", "tune", "-o", "{tmp}/t.json", "--nproc", "1", "--quick", "--max-bytes",
                                   "1MiB"], "--max-bytes: bounds the"),
    ("comm-tune-sizes-min-bytes", ["comm", "tune", "-o", "{tmp}/t.json", "--nproc", "1", "--sizes", "4KiB",
                                   "--min-bytes", "1KiB"], "--min-bytes: bounds the"),
    ("comm-tune-sizes-quick", ["comm", "tune", "-o", "{tmp}/t.json", "--nproc", "1", "--sizes", "4KiB", "--quick"],
     "--quick: measures its own sizes"),
    ("comm-tune-min-bytes-empty", ["comm", "tune", "-o", "{tmp}/t.json", "--nproc", "1", "--min-bytes", ""],
     "--min-bytes"),
    ("comm-tune-threads-huge", ["comm", "tune", "-o", "{tmp}/t.json", "--threads", BIG], "--threads"),
    # data: sizes that would fill the disk or abort, an output that cannot be created
    ("data-generate-items-huge", ["data", "generate", "--items", str(10**12), "--out", "{tmp}/img"], "--items"),
    ("data-generate-image-size-huge", ["data", "generate", "--image-size", str(10**6), "--out", "{tmp}/img"],
     "--image-size"),
    ("data-generate-out-under-file", ["data", "generate", "--items", "1", "--out", "{file}/img"],
     "cannot create directory"),
    ("data-tokenizer-vocab-huge", ["data", "tokenizer", "--vocab", str(10**12), "{file}", "--out", "{tmp}/tok"],
     "--vocab"),
    # an empty --out is no directory (Path("") is the current one)
    ("data-tokenizer-out-empty", ["data", "tokenizer", "{file}", "--out", ""], "--out: empty output directory"),
    ("data-generate-out-empty", ["data", "generate", "--items", "1", "--out", ""], "--out: empty output directory"),
    ("data-whatif-plot-over-report", ["data", "whatif", "--from", "{file}", "--plot", "{file}"], "--from input"),
    # train: outputs over inputs or over each other, refused before anything runs
    ("train-trace-over-config", ["train", "--config", "{tmp}/run_ok.json", "--trace", "{tmp}/run_ok.json"],
     "--config input"),
    ("train-trace-metrics-same", ["train", "--trace", "{tmp}/x.json", "--metrics", "{tmp}/x.json"], "--metrics file"),
    ("train-comm-log-over-data", ["train", "--data", "{file}", "--comm-log", "{file}"], "--data input"),
    ("train-save-final-over-model", ["train", "--model", "{tmp}/mod_ok.json", "--save-final", "{tmp}/mod_ok.json"],
     "--model input"),
    ("train-loader-workers-huge", ["train", "--task", "image", "--loader-workers", str(10**6)], "--loader-workers"),
    # a micro-batch whose activations alone exceed any host (gpt-tiny: ~264 GB at 10^6 x 64 tokens)
    ("plan-density-without-compress", ["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "64",
                                       "--density", "0.05"], "--density"),
    ("train-microbatch-huge", ["train", "--steps", "1", "--microbatch", str(10**6), "--global-batch", str(10**6)],
     "--seq/--microbatch"),
    # gradient compression (issue 14)
    ("train-compress-unknown", ["train", "--compress", "dgc", "--steps", "1"], "--compress"),
    ("train-density-zero", ["train", "--compress", "oktopk", "--density", "0"], "--density"),
    ("train-density-above-one", ["train", "--compress", "oktopk", "--density", "1.5"], "--density"),
    ("train-density-nan", ["train", "--compress", "topka", "--density", "nan"], "--density"),
    ("train-compress-fsdp", ["train", "--compress", "oktopk", "--dp", "2", "--nproc", "2", "--optimizer-sharding"],
     "--compress"),
    ("train-compress-ddp", ["train", "--compress", "oktopk", "--dp", "2", "--nproc", "2", "--dp-impl", "ddp"],
     "--compress"),
    ("train-gtopk-dp3", ["train", "--compress", "gtopk", "--dp", "3", "--nproc", "3"], "power-of-two"),
    ("train-compress-async", ["train", "--compress", "oktopk", "--dp", "2", "--pp", "2", "--nproc", "4",
                              "--schedule", "pipedream"], "asynchronously"),
    ("train-compress-warmup-negative", ["train", "--compress", "oktopk", "--compress-warmup", "-1"],
     "--compress-warmup"),
    ("train-momentum-correction-adamw", ["train", "--compress", "oktopk", "--dp", "2", "--nproc", "2",
                                         "--compress-momentum-correction"], "--optimizer sgd"),
    ("train-momentum-correction-dense", ["train", "--optimizer", "sgd", "--dp", "2", "--nproc", "2",
                                         "--compress-momentum-correction"], "--compress-momentum-correction"),
    ("train-momentum-correction-powersgd", ["train", "--optimizer", "sgd", "--compress", "powersgd", "--dp", "2",
                                            "--nproc", "2", "--compress-momentum-correction"], "sparse compressor"),
    ("train-density-warmup-negative", ["train", "--compress", "oktopk", "--compress-density-warmup", "-2"],
     "--compress-density-warmup"),
    ("train-sgd-checkpoint", ["train", "--optimizer", "sgd", "--checkpoint-dir", "ckpt"], "AdamW's moments"),
    ("train-sgd-pipedream", ["train", "--optimizer", "sgd", "--pp", "2", "--nproc", "2", "--schedule", "pipedream"],
     "--optimizer sgd"),
    ("simulate-density-zero", ["simulate", "--model", "gpt2", "--gpus", "8", "--dp", "8", "--compress", "oktopk",
                               "--density", "0"], "--density"),
    ("plan-compress-unknown", ["plan", "--model", "gpt2", "--gpus", "8", "-b", "64", "--compress", "dgc"],
     "--compress"),
    # K-FAC (runtime/kfac.py) and --fill-bubbles
    ("train-optimizer-unknown", ["train", "--optimizer", "shampoo", "--steps", "1"], "--optimizer"),
    ("train-fill-bubbles-no-pp", ["train", "--optimizer", "kfac", "--fill-bubbles", "--steps", "1"], "--pp > 1"),
    ("train-fill-bubbles-adamw", ["train", "--fill-bubbles", "--pp", "2", "--nproc", "2"], "--optimizer kfac"),
    ("train-kfac-tp", ["train", "--optimizer", "kfac", "--tp", "2", "--nproc", "2"], "tensor parallelism"),
    ("train-kfac-fsdp", ["train", "--optimizer", "kfac", "--dp", "2", "--nproc", "2", "--optimizer-sharding"],
     "FSDP2"),
    ("train-kfac-pipedream", ["train", "--optimizer", "kfac", "--pp", "2", "--nproc", "2", "--schedule",
                              "pipedream"], "asynchronously"),
    ("train-kfac-damping-zero", ["train", "--optimizer", "kfac", "--kfac-damping", "0"], "--kfac-damping"),
    ("train-kfac-refresh-zero", ["train", "--optimizer", "kfac", "--kfac-refresh", "0"], "--kfac-refresh"),
    ("train-kfac-refresh-adamw", ["train", "--kfac-refresh", "4"], "--optimizer"),
    ("train-kfac-refresh-vs-fill", ["train", "--optimizer", "kfac", "--fill-bubbles", "--pp", "2", "--nproc", "2",
                                    "--kfac-refresh", "99"], "--kfac-refresh"),
    ("train-fill-cluster-unknown", ["train", "--optimizer", "kfac", "--fill-bubbles", "--pp", "2", "--nproc", "2",
                                    "--fill-cluster", "no-such-cluster"], "--fill-cluster"),
]


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    for name, make in _FILES.items():
        (tmp_path / name).write_text(make(tmp_path), encoding="utf-8")
    # No calibration of this machine leaks into the cases.
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    # A relative path a command writes by mistake lands here, where the check below sees it.
    monkeypatch.chdir(tmp_path)
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


@pytest.mark.parametrize("argv", [
    ["compare", "{tmp}/measured.json", "{tmp}/predicted.json", "--json"],
    ["schedule", "show", "-f", "{tmp}/sched_ok.json", "--json"],
    ["simulate", "--config", "{tmp}/run_ok.json", "--json"],
])
def test_well_formed_inputs_still_pass(capsys, scratch, argv):
    """The checks above reject only what is wrong: the same inputs done right run."""
    argv = [a.replace("{tmp}", str(scratch)) for a in argv]
    code, out, err, _ = _run(capsys, argv)
    assert code == 0, err
    json.loads(out)


def test_plan_drops_microbatch_sizes_past_the_limit(capsys):
    """A global batch so large that micro-batches of one sample would exceed MAX_MICROBATCHES per
    pipeline: the planner keeps the larger micro-batch sizes instead of failing."""
    from paratrain.parallel.config import MAX_MICROBATCHES
    from paratrain.plan.backend import default_backend
    from paratrain.plan.search import plan
    from paratrain.spec.cluster import resolve_cluster
    from paratrain.spec.model import resolve_model

    batch = 2**20
    res = plan(resolve_model("gpt3-1.3b"), resolve_cluster("dgx-a100", gpus=8), batch,
               backend=default_backend(simulate=False), top=50)
    assert res.rejected.get("too_many_microbatches", 0) > 0
    assert all(c.config.num_microbatches <= MAX_MICROBATCHES for c in res.ranked)
    code, out, err, _ = _run(capsys, ["plan", *M, "--gpus", "8", "--global-batch", str(batch), "--no-simulate",
                                      "--json"])
    assert code == 0, err
    win = json.loads(out)["config"]["parallel"]
    assert batch // (win["dp"] * win["microbatch"]) <= MAX_MICROBATCHES


def test_plan_library_default_is_usable_memory(capsys):
    """Without a memory limit the library plans against the device's usable memory (after its
    reserve and fragmentation), as the CLI does, and the report says which figure it used."""
    from paratrain.plan.backend import default_backend
    from paratrain.plan.report import winner_breakdown
    from paratrain.plan.search import plan
    from paratrain.spec.cluster import resolve_cluster
    from paratrain.spec.model import resolve_model

    model, cluster = resolve_model("gpt3-1.3b"), resolve_cluster("dgx-a100", gpus=8)
    dev = cluster.device
    assert dev.usable_memory_bytes < dev.memory_bytes
    res = plan(model, cluster, 64, backend=default_backend(simulate=False))
    assert res.capacity_bytes == dev.usable_memory_bytes
    assert all(c.metrics.peak_memory_bytes <= dev.usable_memory_bytes for c in res.ranked)
    line = dict(winner_breakdown(model, cluster, res.winner, res.capacity_bytes))["peak memory per GPU"]
    assert f"of {dev.usable_memory_bytes / 2**30:.1f} GiB usable ({dev.memory_bytes / 2**30:.0f} GiB device)" in line
    code, out, err, _ = _run(capsys, ["plan", *M, "--gpus", "8", "--global-batch", "64", "--no-simulate"])
    assert code == 0, err
    assert f"GiB of {dev.usable_memory_bytes / 2**30:.1f} GiB usable (80 GiB device)" in out


def test_longest_legal_file_name_is_written(capsys, tmp_path):
    """A 255-byte name is legal; the temporary file beside it must be too."""
    target = tmp_path / ("c" * 250 + ".json")
    code, _, err, _ = _run(capsys, ["schedule", "show", "-s", "1f1b", "--save", str(target)])
    assert code == 0, err
    assert json.loads(target.read_text())["name"] == "1f1b"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_simulate_says_when_a_layout_does_not_fit(capsys):
    """Simulating a layout whose peak exceeds the device's usable memory is allowed (a what-if),
    but the report says it does not fit instead of printing the peak alone."""
    big = ["simulate", "--model", "gpt3-175b", "--gpus", "8", "--pp", "2", "--global-batch", "8"]
    code, out, err, _ = _run(capsys, [*big, "--json"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["peak_memory_bytes"] > doc["usable_memory_bytes"] and doc["fits_in_memory"] is False
    code, out, err, _ = _run(capsys, big)
    assert code == 0, err
    assert "does not fit" in out
    code, out, err, _ = _run(capsys, [*SIM, "--json"])
    assert code == 0, err
    assert json.loads(out)["fits_in_memory"] is True


@pytest.mark.parametrize("command", [SIM, PLAN, ["cost", *M]], ids=["simulate", "plan", "cost"])
def test_attention_choice_is_case_insensitive(capsys, command):
    """--attention reads MATH as math, as --schedule, --recompute and --sharding ignore case."""
    outs = []
    for value in ("math", "MATH"):
        code, out, err, _ = _run(capsys, [*command, "--attention", value, "--json"])
        assert code == 0, err
        doc = json.loads(out)
        doc.pop("search_time_s", None)  # plan's wall time
        outs.append(doc)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("argv", [
    ["cost", "--model", "{fifo}"],
    ["simulate", "--config", "{fifo}"],
    ["validate", "{fifo}"],
    ["train", "--config", "{fifo}", "--steps", "1"],
], ids=["cost-model", "simulate-config", "validate", "train-config"])
def test_fifo_input_is_not_a_regular_file(capsys, tmp_path, argv):
    """A named pipe given as an input file is named as what it is, not as missing; nothing opens it
    (an open for reading would wait for a writer forever)."""
    import os

    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    code, _, err, elapsed = _run(capsys, [a.replace("{fifo}", str(fifo)) for a in argv])
    assert code == 2, err
    assert err.strip().splitlines() == [err.strip()] and f"'{fifo}' is not a regular file" in err, err
    assert elapsed < 5.0


def test_density_applies_to_a_run_documents_compressor(capsys, scratch):
    """--density alone is refused only where nothing is compressed: it does set the density of a
    compressor a run document names."""
    doc = {"config": {**_RUN, "parallel": {**_RUN["parallel"], "dp": 2, "global_batch": 16,
                                           "compression": "oktopk"}}}
    (scratch / "run_oktopk.json").write_text(json.dumps(doc))
    code, out, err, _ = _run(capsys, ["simulate", "--config", str(scratch / "run_oktopk.json"), "--density", "0.1",
                                      "--json"])
    assert code == 0, err
    assert json.loads(out)["config"]["compression_density"] == 0.1
