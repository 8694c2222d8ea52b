"""Malformed invocations of every command end fast, with exit code 2 and one line that names the
field and the fix: no traceback, no hang, no exit 0 on nonsense, no file written.

Each case runs in-process through ``paratrain.cli.main``. ``{tmp}`` in an argument is a scratch
directory holding the files of ``_FILES``; ``{file}`` is an existing plain file in it.
"""

from __future__ import annotations

import json

import pytest
from tests.cli.bad_input import BIG, PLAN, RUN, SIM, SWEEP, M, check_one_line, run_cli

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
    ("cost-fp8-on-a100", ["cost", *M, "--gemm-dtype", "fp8"], "--gemm-dtype: a100-80gb has no FP8"),
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
    ("cost-hf-act-llama-erf-gelu", ["cost", "--model", "{tmp}/hf_act_llama_gelu.json"],
     "'hidden_act': unknown activation for a gated MLP 'gelu'"),
    ("cost-hf-gemma2", ["cost", "--model", "{tmp}/hf_gemma2.json"], "'model_type': 'gemma2' is not modelled"),
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
    ("simulate-fp8-weight-cache-without-fp8", [*SIM, "--fp8-weight-cache"],
     "--fp8-weight-cache: caches the FP8 copies of the weights, and the linear layers run in the training dtype"),
    ("plan-fp8-weight-cache-without-fp8", [*PLAN, "--fp8-weight-cache"], "--fp8-weight-cache: caches the FP8"),
    ("simulate-prefetch-negative", [*SIM, "--prefetch-receives", "-1"], "--prefetch-receives: must be a whole number"),
    ("simulate-prefetch-huge", [*SIM, "--prefetch-receives", "1000"], "--prefetch-receives"),
    ("simulate-prefetch-no-pipeline", [*SIM, "--pp", "1", "--prefetch-receives", "1"],
     "--prefetch-receives: posts pipeline receives ahead (1), and pp is 1"),
    ("plan-prefetch-negative", [*PLAN, "--prefetch-receives", "-2"], "--prefetch-receives: must be a whole number"),
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
    # compare --step: a step the trace lacks is refused, not replaced by the last step or the whole trace
    ("compare-step-not-in-trace", ["compare", "{tmp}/measured_steps.json", "{tmp}/predicted.json", "--step", "99"],
     "--step: the measured trace has steps 0..2, not 99"),
    ("compare-step-negative", ["compare", "{tmp}/measured_steps.json", "{tmp}/predicted.json", "--step", "-1"],
     "--step: the measured trace has steps 0..2, not -1"),
    ("compare-step-in-a-gap", ["compare", "{tmp}/measured_step_gaps.json", "{tmp}/predicted.json", "--step", "1"],
     "--step: the measured trace has steps 0, 2, 5, not 1"),
    ("compare-step-no-steps", ["compare", "{tmp}/measured.json", "{tmp}/predicted.json", "--step", "99"],
     "--step: the measured trace has no steps"),
    ("compare-step-asynchronous", ["compare", "{tmp}/measured_pipedream.json", "{tmp}/predicted_pipedream.json",
                                   "--step", "0"], "--step: the measured run is asynchronous"),
    ("compare-step-no-value", ["compare", "{tmp}/measured_steps.json", "{tmp}/predicted.json", "--step"],
     "'--step' requires an argument"),
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
    ("data-prepare-tokenizer-device-input", ["data", "prepare", "--tokenizer", "/dev/zero", "--out", "{tmp}/cache",
                                            "{file}"], "--tokenizer: '/dev/zero' is not a regular file"),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2(capsys, scratch, argv, needle):
    check_one_line(capsys, scratch, argv, needle)


@pytest.mark.parametrize("content", ["[1, 2]", "null", "{not json", '{"peak_fp32_flops": NaN}', '{"preset": "cpu"}'])
def test_damaged_calibration_cache_falls_back(capsys, tmp_path, monkeypatch, content):
    """A calibration file that is not a device (list, null, garbage, NaN, a preset loop) is ignored:
    the uncalibrated ``cpu`` preset is used, as when nothing was measured."""
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path))
    (tmp_path / "cpu.json").write_text(content)
    (tmp_path / "cpu-cluster.json").write_text(content)
    code, out, err, _ = run_cli(capsys, ["cost", "--model", "gpt-tiny", "--device", "cpu", "--json"])
    assert code == 0, err
    assert json.loads(out)["device"] == "cpu"
    from paratrain.spec.cluster import resolve_cluster
    from paratrain.spec.device_presets import DEVICE_PRESETS

    assert resolve_cluster("cpu").device == DEVICE_PRESETS["cpu"]


@pytest.mark.parametrize("argv", [
    ["compare", "{tmp}/measured.json", "{tmp}/predicted.json", "--json"],
    ["compare", "{tmp}/measured_steps.json", "{tmp}/predicted.json", "--json"],
    ["compare", "{tmp}/measured_steps.json", "{tmp}/predicted.json", "--step", "0", "--json"],
    ["compare", "{tmp}/measured_step_gaps.json", "{tmp}/predicted.json", "--step", "5", "--json"],
    ["compare", "{tmp}/measured_pipedream.json", "{tmp}/predicted_pipedream.json", "--json"],
    ["schedule", "show", "-f", "{tmp}/sched_ok.json", "--json"],
    ["simulate", "--config", "{tmp}/run_ok.json", "--json"],
])
def test_well_formed_inputs_still_pass(capsys, scratch, argv):
    """The checks above reject only what is wrong: the same inputs done right run."""
    argv = [a.replace("{tmp}", str(scratch)) for a in argv]
    code, out, err, _ = run_cli(capsys, argv)
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
    code, out, err, _ = run_cli(capsys, ["plan", *M, "--gpus", "8", "--global-batch", str(batch), "--no-simulate",
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
    code, out, err, _ = run_cli(capsys, ["plan", *M, "--gpus", "8", "--global-batch", "64", "--no-simulate"])
    assert code == 0, err
    assert f"GiB of {dev.usable_memory_bytes / 2**30:.1f} GiB usable (80 GiB device)" in out


def test_longest_legal_file_name_is_written(capsys, tmp_path):
    """A 255-byte name is legal; the temporary file beside it must be too."""
    target = tmp_path / ("c" * 250 + ".json")
    code, _, err, _ = run_cli(capsys, ["schedule", "show", "-s", "1f1b", "--save", str(target)])
    assert code == 0, err
    assert json.loads(target.read_text())["name"] == "1f1b"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_simulate_says_when_a_layout_does_not_fit(capsys):
    """Simulating a layout whose peak exceeds the device's usable memory is allowed (a what-if),
    but the report says it does not fit instead of printing the peak alone."""
    big = ["simulate", "--model", "gpt3-175b", "--gpus", "8", "--pp", "2", "--global-batch", "8"]
    code, out, err, _ = run_cli(capsys, [*big, "--json"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["peak_memory_bytes"] > doc["usable_memory_bytes"] and doc["fits_in_memory"] is False
    code, out, err, _ = run_cli(capsys, big)
    assert code == 0, err
    assert "does not fit" in out
    code, out, err, _ = run_cli(capsys, [*SIM, "--json"])
    assert code == 0, err
    assert json.loads(out)["fits_in_memory"] is True


@pytest.mark.parametrize("command", [SIM, PLAN, ["cost", *M]], ids=["simulate", "plan", "cost"])
def test_attention_choice_is_case_insensitive(capsys, command):
    """--attention reads MATH as math, as --schedule, --recompute and --sharding ignore case."""
    outs = []
    for value in ("math", "MATH"):
        code, out, err, _ = run_cli(capsys, [*command, "--attention", value, "--json"])
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
    ["data", "prepare", "--tokenizer", "{fifo}", "--out", "{tmp}/cache", "{tmp}/text.txt"],
    ["data", "prepare", "--tokenizer", "{fifodir}", "--out", "{tmp}/cache", "{tmp}/text.txt"],
], ids=["cost-model", "simulate-config", "validate", "train-config", "data-prepare-tokenizer",
       "data-prepare-tokenizer-dir"])
@pytest.mark.timeout(60)  # a read of the pipe would block forever: fail instead
def test_fifo_input_is_not_a_regular_file(capsys, tmp_path, argv):
    """A named pipe given as an input file (or as the file a given directory holds: tokenizer.json)
    is named as what it is, not as missing; nothing opens it (an open for reading would wait for a
    writer forever)."""
    import os

    (tmp_path / "text.txt").write_text("a document\n")
    (tmp_path / "dir").mkdir()
    fifo = tmp_path / "dir" / "tokenizer.json"
    os.mkfifo(fifo)
    subs = {"{fifodir}": str(fifo.parent), "{fifo}": str(fifo), "{tmp}": str(tmp_path)}
    for key, value in subs.items():
        argv = [a.replace(key, value) for a in argv]
    code, _, err, elapsed = run_cli(capsys, argv)
    assert code == 2, err
    assert err.strip().splitlines() == [err.strip()] and f"'{fifo}' is not a regular file" in err, err
    assert elapsed < 5.0


def test_density_applies_to_a_run_documents_compressor(capsys, scratch):
    """--density alone is refused only where nothing is compressed: it does set the density of a
    compressor a run document names."""
    doc = {"config": {**RUN, "parallel": {**RUN["parallel"], "dp": 2, "global_batch": 16,
                                           "compression": "oktopk"}}}
    (scratch / "run_oktopk.json").write_text(json.dumps(doc))
    code, out, err, _ = run_cli(capsys, ["simulate", "--config", str(scratch / "run_oktopk.json"), "--density", "0.1",
                                      "--json"])
    assert code == 0, err
    assert json.loads(out)["config"]["compression_density"] == 0.1


@pytest.mark.parametrize("command", [
    ["simulate", "--model", "gpt2", "--gpus", "8", "--dp", "8", "--compress", "{name}", "--json"],
    ["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "64", "--no-simulate", "--compress", "{name}",
     "--json"],
], ids=["simulate", "plan"])
def test_density_is_taken_by_the_sparse_compressors_only(capsys, command):
    """--density sets a sparse compressor's density and is refused with PowerSGD, which runs
    without it as before."""
    def run(name: str, *extra: str) -> tuple[int, str, str]:
        code, out, err, _ = run_cli(capsys, [*(a.replace("{name}", name) for a in command), *extra])
        return code, out, err

    code, out, err = run("powersgd")
    assert code == 0, err
    for density in (0.001, 0.1):
        code, out, err = run("oktopk", "--density", str(density))
        assert code == 0, err
        cfg = json.loads(out)["config"]
        assert cfg.get("parallel", cfg)["compression_density"] == density  # plan nests the layout
    code, _, err = run("powersgd", "--density", "0.1")
    assert code == 2 and "--density" in err and "powersgd" in err, err
