"""Malformed invocations of the commands that run things (calibrate, comm tune, data, train with
compression and K-FAC, and the compression flags of simulate and plan) end fast, with exit code 2
and one line that names the field and the fix, before any process starts: the cases of
tests/cli/test_bad_input.py for those commands, with the same check (tests/cli/bad_input.py)."""

from __future__ import annotations

import pytest
from tests.cli.bad_input import BIG, check_one_line

# (id, argv, text the one error line must contain)
CASES = [
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
    # a density with no compressor to weigh would be ignored
    ("plan-density-without-compress", ["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "64",
                                       "--density", "0.05"], "--density"),
    # the cost model prices FP8 linear layers; the runtime would train them in the training dtype
    ("train-fp8-config", ["train", "--config", "{tmp}/run_fp8.json", "--nproc", "2", "--steps", "1"],
     "--gemm-dtype: paratrain train does not run fp8 linear layers"),
    ("train-density-without-compress", ["train", "--density", "0.1", "--steps", "1"],
     "--density: sets the fraction a gradient compressor keeps, and none is chosen"),
    # ... and so would one for PowerSGD, low-rank (a fixed rank; no flag sets it)
    ("train-density-powersgd", ["train", "--compress", "powersgd", "--density", "0.1", "--steps", "1"],
     "--density: sets the fraction a sparse compressor keeps; powersgd is low-rank"),
    ("train-density-powersgd-config", ["train", "--config", "{tmp}/run_powersgd.json", "--density", "0.1",
                                       "--steps", "1"], "--density: sets the fraction a sparse compressor keeps"),
    ("simulate-density-powersgd", ["simulate", "--model", "gpt2", "--gpus", "8", "--dp", "8", "--compress",
                                   "powersgd", "--density", "0.1"], "powersgd is low-rank"),
    ("simulate-density-powersgd-config", ["simulate", "--config", "{tmp}/run_powersgd.json", "--density", "0.1"],
     "powersgd is low-rank"),
    ("plan-density-powersgd", ["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "64",
                               "--compress", "powersgd", "--density", "0.05"], "powersgd is low-rank"),
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


@pytest.mark.parametrize("argv, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2(capsys, scratch, argv, needle):
    check_one_line(capsys, scratch, argv, needle)
