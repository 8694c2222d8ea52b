"""Every parallel layout trains exactly like single-process training.

Three torchrun launches (1, 2 and 4 processes, tests/runtime/layout_harness.py) train every layout
of their world size one after another through the step loop ``paratrain train`` runs, each twice:
in fp32 and with the model and every tensor it makes in float64. One ``paratrain train --nproc 4``
launch checks the command's own path (console lines, metrics, trace, final parameters). Each layout
is compared with the single-process run on the same global batch, micro-batch size, data and seed.
Tolerance ``rtol=1e-5`` (the issue's bar), never loosened.

fp32 runs: losses and gradient norms, elementwise. Parameters: float64 runs only. After AdamW a
parameter is ill-conditioned in fp32: Adam divides each element's update by that element's own
gradient magnitude, so an element whose gradient is a near-cancelling sum moves by an amount set by
the rounding of that sum, which a different summation order (tensor parallelism, a data-parallel
all-reduce) changes (measured: blocks.1.attn.o.weight of gpt-tp2 at 1.2e-5 relative error on one
CPU, within 1e-5 on another). In float64 that rounding is ~1e-16, so any difference above ``rtol``
is an error of the algorithm. Per tensor the check is the relative Frobenius error
``|P - P_ref| / |P_ref| <= rtol``. The attention key bias is the exception: its exact gradient is
zero (softmax is invariant to adding ``q·b_k`` to every score), so all it holds is rounding noise;
it is checked to stay at noise level instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.runtime import forkrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]

RTOL = 1e-5
KEY_BIAS_NOISE = 1e-4  # far below one Adam step of lr=3e-3 that a real gradient would cause
STEPS = 5
GLOBAL_BATCH, MICROBATCH, SEED, LR = 8, 2, 3, 3e-3
TRAIN = {"steps": STEPS, "seed": SEED, "lr": LR, "timeout_s": 120}
HARNESS = Path(__file__).with_name("layout_harness.py")

LLAMA_LIKE = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "seq": 32, "vocab": 128,
              "norm": "rmsnorm", "activation": "swiglu", "position": "rotary", "tied_embeddings": False,
              "bias": False, "dtype": "fp32", "name": "llama-like"}

BERT_TINY = {"arch": "bert", "layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128, "dtype": "fp32",
             "name": "bert-tiny"}
MODELS: dict[str, Any] = {"gpt": "gpt-tiny", "llama": LLAMA_LIKE, "bert": BERT_TINY}

# name -> (model, parallel layout, train options beyond TRAIN)
LAYOUTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "gpt-single": ("gpt", {}, {}),
    "gpt-dp2": ("gpt", {"dp": 2}, {}),
    "gpt-dp2-ddp": ("gpt", {"dp": 2}, {"dp_impl": "ddp"}),
    # 64 KiB buckets: the 0.5 MB of gradients go out in many all-reduces launched during backward.
    "gpt-dp2-buckets": ("gpt", {"dp": 2}, {"bucket_bytes": 2**16}),
    "gpt-tp2": ("gpt", {"tp": 2}, {}),
    "gpt-dp2-tp2": ("gpt", {"dp": 2, "tp": 2}, {}),
    "gpt-dp2-tp2-fsdp": ("gpt", {"dp": 2, "tp": 2, "optimizer_sharding": True}, {"dp_impl": "fsdp"}),
    "gpt-tp2-sp": ("gpt", {"tp": 2, "sequence_parallel": True}, {}),
    # the pipeline engine with sequence parallelism: stages exchange the residual stream's slice
    "gpt-pp2-tp2-sp": ("gpt", {"pp": 2, "tp": 2, "sequence_parallel": True}, {}),
    # the split backward: the norms' partial gradients summed over the W passes, reduced by the last
    "gpt-pp2-tp2-sp-zb-h1": ("gpt", {"pp": 2, "tp": 2, "sequence_parallel": True, "schedule": "zb-h1"}, {}),
    "llama-single": ("llama", {}, {}),
    "llama-dp2-tp2": ("llama", {"dp": 2, "tp": 2}, {}),
    "bert-single": ("bert", {}, {}),
    "bert-tp2-sp": ("bert", {"tp": 2, "sequence_parallel": True}, {}),
    # context parallelism: ring attention over the cp ranks, each on 2 of 2*cp sequence chunks
    "gpt-cp2": ("gpt", {"cp": 2}, {}),
    "gpt-cp2-ddp": ("gpt", {"cp": 2}, {"dp_impl": "ddp"}),
    "gpt-cp4": ("gpt", {"cp": 4}, {}),
    "gpt-dp2-cp2": ("gpt", {"dp": 2, "cp": 2}, {}),
    "gpt-tp2-cp2-sp": ("gpt", {"tp": 2, "cp": 2, "sequence_parallel": True}, {}),
    # optimizer state (zero1) and FSDP2's shards cut over the dp x cp ranks
    "gpt-cp2-zero1": ("gpt", {"cp": 2, "sharding": "zero1"}, {}),
    "gpt-dp2-cp2-zero3": ("gpt", {"dp": 2, "cp": 2, "sharding": "zero3"}, {"dp_impl": "fsdp"}),
    # the pipeline engine: stages exchange the rank's tokens; R reduces over dp x cp
    "gpt-pp2-cp2": ("gpt", {"pp": 2, "cp": 2}, {}),
    "gpt-pp2-cp2-zb-h1": ("gpt", {"pp": 2, "cp": 2, "schedule": "zb-h1"}, {}),
    "llama-cp2": ("llama", {"cp": 2}, {}),
    "llama-tp2-cp2": ("llama", {"tp": 2, "cp": 2}, {}),
    # unmasked ring; the masked-LM loss over the micro-batch's masked tokens on every cp rank
    "bert-cp2": ("bert", {"cp": 2}, {}),
    "bert-tp2-cp2-sp": ("bert", {"tp": 2, "cp": 2, "sequence_parallel": True}, {}),
}
TRACED = {"gpt-dp2-buckets"}
# float64 only (the stricter check): the context-parallel variants beyond cp 2 itself and the split
# backward under tensor parallelism, to keep the launch short; their fp32 paths are the same code
FP64_ONLY = ({n for n, (_, layout, _) in LAYOUTS.items() if layout.get("cp", 1) > 1} - {"gpt-cp2"}) | {
    "gpt-pp2-tp2-sp-zb-h1"}


def _world(layout: dict[str, Any]) -> int:
    return layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)


def _read(out: Path, name: str) -> dict[str, Any]:
    rows = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
    run = {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
           "params": torch.load(out / f"{name}.pt")}
    if (out / f"{name}.trace.json").exists():
        run["trace"] = json.loads((out / f"{name}.trace.json").read_text())
    return run


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _harness(out: Path, nproc: int) -> dict[str, dict[str, Any]]:
    """Every layout of world size ``nproc``, fp32 and float64, in one launch."""
    runs = []
    for name, (model, layout, extra) in LAYOUTS.items():
        if _world(layout) != nproc:
            continue
        parallel = {"global_batch": GLOBAL_BATCH, "microbatch": MICROBATCH, **layout}
        for fp64 in (True,) if name in FP64_ONLY else (False, True):
            key = name + (":fp64" if fp64 else "")
            train = {**TRAIN, **extra}
            if name in TRACED and not fp64:
                train["trace"] = str(out / f"{key}.trace.json")
            runs.append({"name": key, "model": MODELS[model], "parallel": parallel, "train": train, "fp64": fp64})
    spec = out / "runs.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    cmd = forkrun.command(nproc, str(HARNESS), str(spec))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=_env())
    assert proc.returncode == 0, f"launch of {nproc} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return {r["name"]: _read(out, r["name"]) for r in runs}


def _cli(out: Path) -> dict[str, Any]:
    """``paratrain train --nproc 4 --dp 2 --tp 2`` itself (fp32), with every output flag."""
    metrics, params, trace = out / "cli.jsonl", out / "cli.pt", out / "cli.trace.json"
    cmd = [sys.executable, "-m", "paratrain", "train", "--model", "gpt-tiny", "--steps", str(STEPS),
           "--global-batch", str(GLOBAL_BATCH), "--microbatch", str(MICROBATCH), "--seed", str(SEED), "--lr", str(LR),
           "--no-progress", "--timeout", "120", "--dp", "2", "--tp", "2", "--nproc", "4",
           "--metrics", str(metrics), "--save-final", str(params), "--trace", str(trace)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, f"paratrain train failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {**_read(out, "cli"), "stdout": proc.stdout}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("layouts")
    every: dict[str, dict[str, Any]] = {}
    for nproc in (1, 2, 4):
        every.update(_harness(out, nproc))
    every["cli"] = _cli(out)
    return every


def _assert_same_training(runs: dict[str, dict[str, Any]], name: str, ref: str) -> None:
    """fp32: losses and gradient norms; float64: losses, gradient norms and parameters."""
    for suffix in (":fp64",) if name in FP64_ONLY else ("", ":fp64"):
        run, want = runs[name + suffix], runs[ref + suffix]
        assert len(run["losses"]) == STEPS
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want["losses"]), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(want["grad_norms"]), rtol=RTOL,
                                   atol=0)
    run64 = runs[name + ":fp64"]["params"]
    assert all(v.dtype == torch.float64 for v in run64.values())
    _assert_same_params(run64, runs[ref + ":fp64"]["params"])


def _assert_same_params(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert params.keys() == ref.keys()
    for key, value in ref.items():
        if key.endswith("attn.k.bias"):
            assert float(params[key].abs().max()) < KEY_BIAS_NOISE, key
            continue
        rel = float((params[key] - value).norm() / value.norm())
        assert rel <= RTOL, f"{key}: relative error {rel:.2e} > {RTOL:g}"


@pytest.mark.parametrize("name", ["gpt-dp2", "gpt-dp2-ddp", "gpt-dp2-buckets", "gpt-tp2", "gpt-dp2-tp2",
                                  "gpt-dp2-tp2-fsdp", "gpt-tp2-sp", "gpt-pp2-tp2-sp", "gpt-pp2-tp2-sp-zb-h1"])
def test_gpt_layout_matches_single_process(runs: dict[str, dict[str, Any]], name: str) -> None:
    _assert_same_training(runs, name, "gpt-single")


def test_llama_like_dp2_tp2_matches_single_process(runs: dict[str, dict[str, Any]]) -> None:
    # GQA (2 key/value heads over tp=2), SwiGLU, RMSNorm, rotary, untied output, no biases.
    _assert_same_training(runs, "llama-dp2-tp2", "llama-single")


@pytest.mark.parametrize("name", ["gpt-cp2", "gpt-cp2-ddp", "gpt-cp4", "gpt-dp2-cp2", "gpt-tp2-cp2-sp", "gpt-cp2-zero1",
                                  "gpt-dp2-cp2-zero3", "gpt-pp2-cp2", "gpt-pp2-cp2-zb-h1"])
def test_gpt_context_parallel_matches_single_process(runs: dict[str, dict[str, Any]], name: str) -> None:
    # learned positions of the rank's zigzag chunks, causal ring attention, gradients over dp x cp
    _assert_same_training(runs, name, "gpt-single")


@pytest.mark.parametrize("name", ["llama-cp2", "llama-tp2-cp2"])
def test_llama_like_context_parallel_matches_single_process(runs: dict[str, dict[str, Any]], name: str) -> None:
    # rotary tables of the rank's positions; the ring carries the key/value heads only (GQA)
    _assert_same_training(runs, name, "llama-single")


def test_bert_tp2_sequence_parallel_matches_single_process(runs: dict[str, dict[str, Any]]) -> None:
    # Post-norm blocks, masked-LM loss over masked positions only, tied MLM decoder with its own bias.
    _assert_same_training(runs, "bert-tp2-sp", "bert-single")


@pytest.mark.parametrize("name", ["bert-cp2", "bert-tp2-cp2-sp"])
def test_bert_context_parallel_matches_single_process(runs: dict[str, dict[str, Any]], name: str) -> None:
    _assert_same_training(runs, name, "bert-single")


def test_paratrain_data_parallel_equals_ddp(runs: dict[str, dict[str, Any]]) -> None:
    ours, ddp = runs["gpt-dp2"], runs["gpt-dp2-ddp"]
    assert ours["losses"] == pytest.approx(ddp["losses"], rel=RTOL, abs=0)
    _assert_same_params(runs["gpt-dp2:fp64"]["params"], runs["gpt-dp2-ddp:fp64"]["params"])


def test_float64_runs_are_not_the_fp32_ones_relabelled(runs: dict[str, dict[str, Any]]) -> None:
    # Guards the parameter checks above: a float64 run differs from its fp32 twin by fp32 rounding.
    for name in ("gpt-single", "gpt-tp2"):
        p32, p64 = runs[name]["params"], runs[name + ":fp64"]["params"]
        assert all(v.dtype == torch.float32 for v in p32.values())
        assert max(float((p64[k] - p32[k].double()).abs().max()) for k in p32) > 0


def test_training_changes_the_model_and_lowers_the_loss(runs: dict[str, dict[str, Any]]) -> None:
    # Guards the comparisons above against a run that trained nothing (all layouts equal to init).
    from paratrain.runtime.models import build_model
    from paratrain.spec.model import preset

    init = dict(build_model(preset("gpt-tiny"), seed=SEED).named_parameters())
    for name in ("gpt-single", "gpt-single:fp64"):
        losses = runs[name]["losses"]
        assert losses[-1] < losses[0] - 0.1
        moved = max(float((runs[name]["params"][k] - p.detach()).abs().max()) for k, p in init.items())
        assert moved > 1e-3


def test_paratrain_train_command_trains_like_one_process(runs: dict[str, dict[str, Any]]) -> None:
    """The command's own launch path (elastic launcher, workers, final save) trains like the step
    loop in one process: fp32 losses and gradient norms (its parameters: the float64 runs above)."""
    cli, ref = runs["cli"], runs["gpt-single"]
    torch.testing.assert_close(torch.tensor(cli["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(cli["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=RTOL, atol=0)
    # --save-final holds every parameter unsharded, as one process has it
    assert {k: v.shape for k, v in cli["params"].items()} == {k: v.shape for k, v in ref["params"].items()}


def test_small_buckets_reduce_during_backward(runs: dict[str, dict[str, Any]]) -> None:
    from paratrain.trace import events_from_chrome_trace

    events = events_from_chrome_trace(runs["gpt-dp2-buckets"]["trace"])
    for rank in (0, 1):
        mine = [e for e in events if e.rank == rank]
        reduces = [e for e in mine if e.stream == "comm"]
        assert len(reduces) > 5 * STEPS  # many buckets per step
        # The first bucket starts before the last micro-batch's backward ends: overlap.
        last_backward = [e for e in mine if e.name == "B1@c0"]
        for step in range(STEPS):
            b = last_backward[step]
            assert any(b.start_s <= r.start_s < b.start_s + b.duration_s for r in reduces)


def test_rank_zero_prints_rank_prefixed_step_lines(runs: dict[str, dict[str, Any]]) -> None:
    lines = [ln for ln in runs["cli"]["stdout"].splitlines() if "step " in ln and "loss" in ln]
    assert len(lines) == STEPS
    assert all(ln.startswith("[rank 0] step ") for ln in lines)


def test_measured_trace_uses_the_simulator_format(runs: dict[str, dict[str, Any]]) -> None:
    from paratrain.trace import events_from_chrome_trace

    doc = runs["cli"]["trace"]
    events = events_from_chrome_trace(doc)
    assert {e.rank for e in events} == {0, 1, 2, 3}
    for rank in range(4):
        mine = [e for e in events if e.rank == rank]
        compute = [e.name for e in mine if e.stream == "compute"]
        # 5 steps x 2 micro-batches per replica (global batch 8 = dp 2 x 2 x microbatch 2).
        assert compute.count("F0@c0") == STEPS and compute.count("B1@c0") == STEPS
        assert compute.count("U") == STEPS
        reduces = [e for e in mine if e.stream == "comm"]
        assert reduces and all(e.name == "R@c0" and e.category == "reduce" for e in reduces)
        assert len(reduces) == STEPS  # gpt-tiny's gradients fit one 25 MiB bucket
        forward = next(e for e in mine if e.name == "F0@c0")
        assert forward.category == "forward" and forward.microbatch == 0 and forward.duration_s > 0
    starts = sorted(e.start_s for e in events)
    assert starts[0] >= 0 and starts[-1] < 600  # one time origin for all ranks
    # every event carries its step; each step's forwards lie after the previous step's update
    steps = [e["args"]["step"] for e in doc["traceEvents"] if e["ph"] == "X"]
    assert sorted(set(steps)) == list(range(STEPS))


def test_measured_trace_says_what_ran_without_a_pipeline(runs: dict[str, dict[str, Any]]) -> None:
    """pp=1 traces carry the metadata ``paratrain calibrate --from-trace`` and ``compare`` need."""
    from paratrain.parallel.config import ParallelConfig
    from paratrain.spec.model import from_document, preset

    meta = runs["cli"]["trace"]["metadata"]
    assert meta["source"] == "paratrain train (measured)" and meta["model"] == "gpt-tiny"
    assert from_document(meta["model_spec"]) == preset("gpt-tiny")
    cfg = ParallelConfig.from_dict(meta["parallel"])
    assert (cfg.dp, cfg.tp, cfg.pp, cfg.global_batch, cfg.microbatch) == (2, 2, 1, GLOBAL_BATCH, MICROBATCH)
    assert (meta["stages"], meta["microbatches"], meta["iterations"], meta["steps"]) == (1, 2, 1, STEPS)
    assert meta["schedule"] == "1f1b"
