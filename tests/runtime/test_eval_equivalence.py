"""Validation loss under tensor, data and pipeline parallelism equals the single-process value.

One 4-process launch (tests/runtime/layout_harness.py) trains ten runs in float64 on a token
cache, evaluating after steps 2 and 3 (``--eval-every 2``, and after the last step): dp=2×tp=2
(paratrain's data parallelism and FSDP2), pp=2×dp=2 (1F1B; Chimera, whose replica-0 chunks
evaluate; interleaved, two chunks per rank on a 4-layer model; PipeDream-2BW, drained where an
evaluation is due), pp=2×tp=2 (GPipe, the vocabulary-parallel loss on the last stage), dp=2×cp=2
and pp=2×cp=2 (ring attention, each rank on its chunks of every sequence), and a BERT under
dp=2×tp=2. Each
layout's final ``eval_loss`` is compared with a single-process computation written out here: the
full model with the layout's final parameters, the eval batches' token cross-entropy summed with
``F.cross_entropy(reduction="sum")`` and divided by the number of targets. The layouts' evaluations
after step 2 are compared with each other (they train the same model on the same data).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tests.runtime import forkrun

from paratrain.runtime.data.text import stdlib_dir
from paratrain.runtime.data.tokenized import (
    TokenDataSource,
    find_documents,
    load_tokenizer,
    open_token_cache,
    prepare,
    train_tokenizer,
)
from paratrain.runtime.models import build_model
from paratrain.spec.model import from_document

pytestmark = [pytest.mark.dist, pytest.mark.slow]

RTOL = 1e-9  # float64 throughout: only summation order differs between layouts
HARNESS = Path(__file__).with_name("layout_harness.py")
MODEL = {"layers": 2, "hidden": 32, "heads": 4, "seq": 32, "vocab": 320, "dtype": "fp32", "name": "gpt-eval"}
GLOBAL_BATCH, MICROBATCH, SEED, EVAL_BATCHES = 8, 2, 5, 2
LAYOUTS = {
    "dp2-tp2": {"dp": 2, "tp": 2},
    "dp2-tp2-fsdp": {"dp": 2, "tp": 2, "optimizer_sharding": True},
    "pp2-dp2": {"pp": 2, "dp": 2, "schedule": "1f1b"},
    "pp2-tp2": {"pp": 2, "tp": 2, "schedule": "gpipe"},
    "pp2-dp2-chimera": {"pp": 2, "dp": 2, "schedule": "chimera"},
    # two chunks per pipeline rank: the activation goes 0 -> 1 -> 0 -> 1
    "pp2-dp2-interleaved": {"pp": 2, "dp": 2, "schedule": "interleaved", "virtual_stages": 2},
    # asynchronous: the pipeline drains where an evaluation is due (after steps 2 and 3)
    "pp2-dp2-2bw": {"pp": 2, "dp": 2, "schedule": "2bw"},
    # ring attention: each cp rank sums the loss over its tokens of every sequence
    "dp2-cp2": {"dp": 2, "cp": 2},
    "pp2-cp2": {"pp": 2, "cp": 2, "schedule": "1f1b"},
}
# 2BW computes on stashed weight versions: not the others' training, compared only with its own reference
ASYNC = {"pp2-dp2-2bw"}
# BERT: masked positions differ per sample, so the token-weighted mean differs from a mean of
# per-micro-batch means
LAYOUTS["bert-dp2-tp2"] = {"dp": 2, "tp": 2}
MODEL_OF = {"pp2-dp2-interleaved": {**MODEL, "layers": 4}, "bert-dp2-tp2": {**MODEL, "arch": "bert", "name": "bert"}}


def _caches(tmp: Path) -> tuple[Path, Path]:
    files = sorted(stdlib_dir().glob("*.py"))
    train_dir, eval_dir = tmp / "train_text", tmp / "eval_text"
    train_dir.mkdir()
    eval_dir.mkdir()
    for f in files[:6]:
        (train_dir / (f.stem + ".txt")).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
    for f in files[6:9]:
        (eval_dir / (f.stem + ".txt")).write_text(f.read_text(encoding="utf-8"), encoding="utf-8")
    tok = train_tokenizer(find_documents([str(train_dir)]), 300, tmp / "tok")
    prepare(find_documents([str(train_dir)]), tok, tmp / "train_cache")
    prepare(find_documents([str(eval_dir)]), load_tokenizer(tmp / "tok"), tmp / "eval_cache")
    return tmp / "train_cache", tmp / "eval_cache"


def _reference_eval(model_doc: dict[str, object], params: dict[str, torch.Tensor], eval_cache: Path) -> float:
    spec = from_document(model_doc)
    # float64 as in the workers: the model, and BERT's masks (torch.rand draws the default dtype)
    torch.set_default_dtype(torch.float64)
    try:
        model = build_model(spec, SEED)
        assert set(params) == set(dict(model.named_parameters()))  # a tied head is the embedding's Parameter
        model.load_state_dict(params, strict=False)
        source = TokenDataSource(open_token_cache(eval_cache), spec, seed=SEED, global_batch=GLOBAL_BATCH,
                                 microbatch=MICROBATCH)
        total, count = 0.0, 0
        with torch.no_grad():
            for k in range(EVAL_BATCHES):
                inputs, targets = source.global_batch_tokens(k)
                logits = model(inputs)
                total += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
                count += int((targets != -100).sum())  # BERT: the masked positions only
    finally:
        torch.set_default_dtype(torch.float32)
    return total / count


def test_eval_loss_matches_single_process_under_tp_dp_and_pipelines(tmp_path: Path) -> None:
    train_cache, eval_cache = _caches(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    train = {"steps": 3, "seed": SEED, "lr": 3e-3, "timeout_s": 120, "data": str(train_cache),
             "eval_data": str(eval_cache), "eval_every": 2, "eval_batches": EVAL_BATCHES}
    runs = [{"name": name, "model": MODEL_OF.get(name, MODEL), "fp64": True,
             "train": {**train, "dp_impl": "fsdp"} if layout.get("optimizer_sharding") else train,
             "parallel": {"global_batch": GLOBAL_BATCH, "microbatch": MICROBATCH, **layout}}
            for name, layout in LAYOUTS.items()]
    (out / "runs.json").write_text(json.dumps({"out": str(out), "runs": runs}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = forkrun.command(4, str(HARNESS), str(out / "runs.json"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"

    evals: dict[str, dict[int, float]] = {}
    for name in LAYOUTS:
        rows = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        evals[name] = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
        assert sorted(evals[name]) == [1, 2], name  # after step 2 (every 2) and after the last step
        last = rows[-1]
        assert last["eval_ppl"] == pytest.approx(math.exp(last["eval_loss"]), rel=1e-12)
        expected = _reference_eval(MODEL_OF.get(name, MODEL), torch.load(out / f"{name}.pt"), eval_cache)
        assert last["eval_loss"] == pytest.approx(expected, rel=RTOL), name
    first = evals["dp2-tp2"][1]
    for name in LAYOUTS.keys() - MODEL_OF.keys() - ASYNC:  # the same model trained the same way
        assert evals[name][1] == pytest.approx(first, rel=RTOL), name
