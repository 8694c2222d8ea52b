"""Every parallel layout trains exactly like single-process training.

Each layout is one launch of ``paratrain train --nproc N`` (gloo on CPU, fp32) writing its per-step
losses (``--metrics``) and final unsharded parameters (``--save-final``) to a temporary directory;
the tests compare every layout with the single-process run on the same global batch, micro-batch
size, data and seed. Tolerance ``rtol=1e-5`` (the issue's bar), never loosened.

Losses and gradient norms are compared elementwise. Parameters are compared per tensor by
relative Frobenius error ``|P - P_ref| / |P_ref| <= rtol``: after AdamW an elementwise comparison
is ill-conditioned, because Adam divides each element's update by that element's own gradient
magnitude — an element whose gradient is a near-cancelling sum (rounding noise of order 1e-10)
moves by a noise-dependent amount up to ``lr`` whatever its size. The attention key bias is the
extreme case: its exact gradient is zero (softmax is invariant to adding ``q·b_k`` to every
score), so all it holds is rounding noise; it is checked to stay at noise level instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

RTOL = 1e-5
KEY_BIAS_NOISE = 1e-4  # far below one Adam step of lr=3e-3 that a real gradient would cause
STEPS = 5
COMMON = ["--steps", str(STEPS), "--global-batch", "8", "--microbatch", "2", "--seed", "3", "--lr", "3e-3",
          "--no-progress", "--timeout", "120"]

LLAMA_LIKE = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "seq": 32, "vocab": 128,
              "norm": "rmsnorm", "activation": "swiglu", "position": "rotary", "tied_embeddings": False,
              "bias": False, "dtype": "fp32", "name": "llama-like"}

BERT_TINY = {"arch": "bert", "layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128, "dtype": "fp32",
             "name": "bert-tiny"}
MODEL_FILES = {"llama": LLAMA_LIKE, "bert": BERT_TINY}

# name -> (model, nproc, flags)
LAYOUTS = {
    "gpt-single": ("gpt-tiny", 1, []),
    "gpt-dp2": ("gpt-tiny", 2, ["--dp", "2"]),
    "gpt-dp2-ddp": ("gpt-tiny", 2, ["--dp", "2", "--dp-impl", "ddp"]),
    # 64 KiB buckets: the 0.5 MB of gradients go out in many all-reduces launched during backward.
    "gpt-dp2-buckets": ("gpt-tiny", 2, ["--dp", "2", "--bucket-mb", "0.0625", "--dp-impl", "paratrain"]),
    "gpt-tp2": ("gpt-tiny", 2, ["--tp", "2"]),
    "gpt-dp2-tp2": ("gpt-tiny", 4, ["--dp", "2", "--tp", "2"]),
    "gpt-dp2-tp2-fsdp": ("gpt-tiny", 4, ["--dp", "2", "--tp", "2", "--optimizer-sharding"]),
    "gpt-tp2-sp": ("gpt-tiny", 2, ["--tp", "2", "--sequence-parallel"]),
    "llama-single": ("llama", 1, []),
    "llama-dp2-tp2": ("llama", 4, ["--dp", "2", "--tp", "2"]),
    "bert-single": ("bert", 1, []),
    "bert-tp2-sp": ("bert", 2, ["--tp", "2", "--sequence-parallel"]),
}


def _launch(tmp: Path, name: str) -> dict[str, object]:
    model, nproc, flags = LAYOUTS[name]
    if model in MODEL_FILES:
        path = tmp / f"{model}.json"
        path.write_text(json.dumps(MODEL_FILES[model]))
        model = str(path)
    metrics, params = tmp / f"{name}.jsonl", tmp / f"{name}.pt"
    trace = tmp / f"{name}.trace.json"
    cmd = [sys.executable, "-m", "paratrain", "train", "--model", model, *COMMON, *flags,
           "--metrics", str(metrics), "--save-final", str(params), "--trace", str(trace)]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
            "params": torch.load(params), "stdout": proc.stdout, "trace": json.loads(trace.read_text())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    tmp = tmp_path_factory.mktemp("layouts")
    return {name: _launch(tmp, name) for name in LAYOUTS}


def _assert_same_training(run: dict[str, object], ref: dict[str, object]) -> None:
    assert len(run["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=RTOL, atol=0)
    _assert_same_params(run["params"], ref["params"])


def _assert_same_params(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert params.keys() == ref.keys()
    for key, value in ref.items():
        if key.endswith("attn.k.bias"):
            assert float(params[key].abs().max()) < KEY_BIAS_NOISE, key
            continue
        rel = float((params[key] - value).norm() / value.norm())
        assert rel <= RTOL, f"{key}: relative error {rel:.2e} > {RTOL:g}"


@pytest.mark.parametrize("name", ["gpt-dp2", "gpt-dp2-ddp", "gpt-dp2-buckets", "gpt-tp2", "gpt-dp2-tp2",
                                  "gpt-dp2-tp2-fsdp", "gpt-tp2-sp"])
def test_gpt_layout_matches_single_process(runs: dict[str, dict[str, object]], name: str) -> None:
    _assert_same_training(runs[name], runs["gpt-single"])


def test_llama_like_dp2_tp2_matches_single_process(runs: dict[str, dict[str, object]]) -> None:
    # GQA (2 key/value heads over tp=2), SwiGLU, RMSNorm, rotary, untied output, no biases.
    _assert_same_training(runs["llama-dp2-tp2"], runs["llama-single"])


def test_bert_tp2_sequence_parallel_matches_single_process(runs: dict[str, dict[str, object]]) -> None:
    # Post-norm blocks, masked-LM loss over masked positions only, tied MLM decoder with its own bias.
    _assert_same_training(runs["bert-tp2-sp"], runs["bert-single"])


def test_paratrain_data_parallel_equals_ddp(runs: dict[str, dict[str, object]]) -> None:
    ours, ddp = runs["gpt-dp2"], runs["gpt-dp2-ddp"]
    assert ours["losses"] == pytest.approx(ddp["losses"], rel=RTOL, abs=0)
    _assert_same_params(ours["params"], ddp["params"])


def test_training_changes_the_model_and_lowers_the_loss(runs: dict[str, dict[str, object]]) -> None:
    # Guards the comparisons above against a run that trained nothing (all layouts equal to init).
    losses = runs["gpt-single"]["losses"]
    assert losses[-1] < losses[0] - 0.1
    from paratrain.runtime.models import build_model
    from paratrain.spec.model import preset

    init = dict(build_model(preset("gpt-tiny"), seed=3).named_parameters())
    moved = max(float((runs["gpt-single"]["params"][k] - p.detach()).abs().max()) for k, p in init.items())
    assert moved > 1e-3


def test_small_buckets_reduce_during_backward(runs: dict[str, dict[str, object]]) -> None:
    from paratrain.sim.trace import events_from_chrome_trace

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


def test_rank_zero_prints_rank_prefixed_step_lines(runs: dict[str, dict[str, object]]) -> None:
    lines = [ln for ln in runs["gpt-dp2-tp2"]["stdout"].splitlines() if "step " in ln and "loss" in ln]
    assert len(lines) == STEPS
    assert all(ln.startswith("[rank 0] step ") for ln in lines)


def test_measured_trace_uses_the_simulator_format(runs: dict[str, dict[str, object]]) -> None:
    from paratrain.sim.trace import events_from_chrome_trace

    events = events_from_chrome_trace(runs["gpt-dp2-tp2"]["trace"])
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
