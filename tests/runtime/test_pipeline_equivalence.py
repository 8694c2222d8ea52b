"""The pipeline engine trains exactly like single-process training (gloo, CPU, fp32, tiny GPT).

One torchrun launch of 4 processes (pp=4) trains every schedule in turn
(tests/runtime/pipeline_harness.py); one launch of 8 processes trains pp=2 × tp=2 × dp=2. The
references are written here in plain torch, independently of the engine:

* synchronous schedules (GPipe, 1F1B, interleaved, Chimera, ZB-H1) and the 3-D layout: one model,
  gradient accumulation over the ``M`` micro-batches of the global batch, global-norm clipping,
  AdamW — the loop every data-parallel test also compares against;
* PipeDream (Narayanan et al., SOSP'19): an optimizer step per micro-batch on every stage; the
  forward and backward of micro-batch ``k`` on stage ``r`` use the stage's weights after
  ``max(0, k-(p-1-r))`` of its own steps (1F1B warm-up of ``p-1-r`` micro-batches in flight, weight
  stashing); each stage clips by its own gradient norm;
* PipeDream-2BW (Narayanan et al., ICML'21): batch ``t`` is computed on version ``max(t-1, 0)`` of
  every stage, ``W(t+1) = W(t) − step(∇f(W(t−1)))`` with the gradient accumulated over the batch.

Tolerance ``rtol=1e-5`` (atol 1e-6 for parameters near zero), never loosened. The pp=4 schedules
train in float64 (the model and every tensor it makes) against float64 references: in fp32, Adam
turns the rounding of a different summation order into parameter differences of a few 1e-6 for
an element whose gradient nearly cancels, and which elements do depends on the CPU's BLAS kernels
(measured: PipeDream's ``embed.tok.weight`` off by 1.2e-6 in one element on a 16-core machine,
within 1e-6 on this 2-core one). The 3-D layout checks fp32 losses and gradient norms as well.
The data is real text (1 MiB of the standard library's sources): with random tokens many
gradient elements are near zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch
from tests.runtime import forkrun
from torch.func import functional_call

from paratrain.runtime.data import DataSource, load_corpus
from paratrain.runtime.models import TransformerLM, build_model
from paratrain.runtime.train import TrainConfig, lr_at
from paratrain.spec.model import preset

pytestmark = [pytest.mark.dist, pytest.mark.slow]

RTOL, ATOL_PARAMS = 1e-5, 1e-6
RTOL_F64, ATOL_PARAMS_F64 = 1e-9, 1e-10  # float64: rounding ~1e-16, Adam-amplified to ~1e-13
STEPS, LAYERS, GLOBAL_BATCH, MICROBATCH, SEED, LR, STAGES = 3, 8, 8, 2, 3, 3e-3, 4
SYNC = ["gpipe", "1f1b", "interleaved", "chimera", "zb-h1"]
ASYNC = ["pipedream", "2bw"]
HARNESS = Path(__file__).with_name("pipeline_harness.py")
DATA_CAP_BYTES = 2**20  # as in the harness


def _torchrun(out: Path, nproc: int, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = forkrun.command(nproc, str(HARNESS), "--out", str(out),
           "--steps", str(STEPS), "--layers", str(LAYERS), "--global-batch", str(GLOBAL_BATCH),
           "--microbatch", str(MICROBATCH), "--seed", str(SEED), "--lr", str(LR), *args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def pp4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("pp4")
    names = [f"{n}:fp64" for n in SYNC] + [f"{n}:untied:fp64" for n in ASYNC] + ["interleaved:noprefetch:fp64"]
    _torchrun(out, 4, "--pp", "4", "--trace", "--schedules", ",".join(names))
    runs = {}
    for n in names:
        runs[n.replace(":untied", "").replace(":fp64", "")] = {**torch.load(out / f"{n.replace(':', '-')}.pt"),
                                 "trace": json.loads((out / f"{n.replace(':', '-')}.trace.json").read_text())}
    return runs


@pytest.fixture(scope="module")
def pp2_tp2_dp2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("pp2tp2dp2")
    _torchrun(out, 8, "--pp", "2", "--tp", "2", "--dp", "2", "--schedules", "1f1b,1f1b:fp64")
    return {"fp32": torch.load(out / "1f1b.pt"), "fp64": torch.load(out / "1f1b-fp64.pt")}


# ----- references --------------------------------------------------------------------------------

def _spec(tied: bool = True):
    return dataclasses.replace(preset("gpt-tiny"), layers=LAYERS, tied_embeddings=tied, bias=False)


@pytest.fixture(autouse=True)
def _one_thread():
    # The workers run one thread each: the same kernels (and roundings) as the references here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train_cfg() -> TrainConfig:
    return TrainConfig(steps=STEPS, seed=SEED, lr=LR, data="stdlib", data_cap_bytes=DATA_CAP_BYTES)


def _adamw(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=cfg.betas, eps=1e-8, foreach=False)


def _clip(params: list[torch.nn.Parameter], max_norm: float) -> float:
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params if p.grad is not None))
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)
    return float(norm)


def _data(spec) -> DataSource:
    return DataSource(load_corpus("stdlib", DATA_CAP_BYTES), spec, seed=SEED, global_batch=GLOBAL_BATCH,
                      microbatch=MICROBATCH)


def _named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def reference_sync(tied: bool = True, groups: int = 1, dtype: torch.dtype = torch.float32) -> dict:
    """Single process, gradient accumulation over the global batch (model and optimizer in ``dtype``).

    ``groups=2`` accumulates the micro-batches of Chimera's two replicas (the first and second
    half of each group of ``p`` micro-batches) separately and adds the two sums, the order in which
    Chimera's all-reduce adds them: the same gradient up to fp32 rounding, which Adam amplifies
    beyond ``rtol`` for the odd near-zero element otherwise.
    """
    spec, cfg = _spec(tied), _train_cfg()
    with _default_dtype(dtype):
        model = build_model(spec, SEED)
    params = [p for p in model.parameters()]
    opt, data = _adamw(params, cfg), _data(spec)
    losses, norms = [], []
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        batch = data.local_batch(step, 0, 1)
        n = batch.num_microbatches
        total = 0.0
        sums: list[list[torch.Tensor]] = []
        for g in range(groups):
            for p in params:
                p.grad = None
            for i in range(n):
                if groups > 1 and (i % STAGES) * 2 // STAGES != g:
                    continue
                x, y = batch.microbatch(i)
                loss = TransformerLM.loss(model(x), y) / n
                loss.backward()
                total += float(loss.detach())
            sums.append([p.grad for p in params])
        for p, *gs in zip(params, *sums, strict=True):
            p.grad = gs[0] if groups == 1 else gs[0] + gs[1]
        norms.append(_clip(params, cfg.grad_clip))
        opt.step()
        losses.append(total)
    return {"losses": losses, "grad_norms": norms, "params": _named(model)}


def reference_async(kind: str, stages: int = 4, dtype: torch.dtype = torch.float32) -> dict:
    """PipeDream / 2BW on ``stages`` stages of one untied model, per the module docstring."""
    spec, cfg = _spec(tied=False), _train_cfg()
    with _default_dtype(dtype):
        model = build_model(spec, SEED)
    per = LAYERS // stages
    chunks = [model.chunk(r * per, (r + 1) * per) for r in range(stages)]
    params = [dict(c.named_parameters()) for c in chunks]
    opts = [_adamw(list(p.values()), cfg) for p in params]
    history = [[{n: t.detach().clone() for n, t in p.items()}] for p in params]  # [stage][version]
    data = _data(spec)
    m = GLOBAL_BATCH // MICROBATCH
    losses = [0.0] * STEPS

    def run(mb: int, versions: list[int], scale: float) -> list[dict[str, torch.Tensor]]:
        x, y = data.local_batch(mb // m, 0, 1).microbatch(mb % m)
        weights = [{n: t.clone().requires_grad_(True) for n, t in history[r][versions[r]].items()}
                   for r in range(stages)]
        h = x
        for r in range(stages):
            h = functional_call(chunks[r], weights[r], (h,))
        loss = TransformerLM.loss(h, y)
        losses[mb // m] += float(loss.detach()) / m
        (loss * scale).backward()
        return [{n: w.grad for n, w in weights[r].items()} for r in range(stages)]

    def apply(r: int, grads: dict[str, torch.Tensor], step: int) -> None:
        for n, p in params[r].items():
            p.grad = grads[n].clone()
        for g in opts[r].param_groups:
            g["lr"] = lr_at(step, cfg)
        _clip(list(params[r].values()), cfg.grad_clip)
        opts[r].step()
        opts[r].zero_grad(set_to_none=True)
        history[r].append({n: t.detach().clone() for n, t in params[r].items()})

    if kind == "pipedream":
        for k in range(STEPS * m):
            grads = run(k, [max(0, k - (stages - 1 - r)) for r in range(stages)], 1.0)
            for r in range(stages):
                apply(r, grads[r], k // m)
    else:
        for t in range(STEPS):
            acc: list[dict[str, torch.Tensor]] = [{} for _ in range(stages)]
            for i in range(m):
                grads = run(t * m + i, [max(t - 1, 0)] * stages, 1.0 / m)
                for r in range(stages):
                    for n, g in grads[r].items():
                        acc[r][n] = acc[r][n] + g if n in acc[r] else g
            for r in range(stages):
                apply(r, acc[r], t)
    return {"losses": losses, "params": _named(model)}


# ----- comparisons ---------------------------------------------------------------------------------

def _same_params(run: dict, ref: dict) -> None:
    """Elementwise; float64 runs at float64's own bar (measured within 1.1e-13 of the reference,
    see the 3-D test), where ``RTOL``/``ATOL_PARAMS`` would let an error of 1e-6 pass."""
    assert run["params"].keys() == ref["params"].keys()
    for key, value in ref["params"].items():
        f64 = value.dtype == torch.float64
        torch.testing.assert_close(run["params"][key], value, rtol=RTOL_F64 if f64 else RTOL,
                                   atol=ATOL_PARAMS_F64 if f64 else ATOL_PARAMS,
                                   msg=lambda msg, k=key: f"{k}: {msg}")


@pytest.fixture(scope="module")
def sync_ref() -> dict:
    return reference_sync(dtype=torch.float64)


@pytest.mark.parametrize("name", SYNC)
def test_synchronous_schedule_matches_gradient_accumulation(pp4: dict, sync_ref: dict, name: str) -> None:
    run = pp4[name]
    if name == "chimera":
        sync_ref = reference_sync(groups=2, dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(sync_ref["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(sync_ref["grad_norms"]), rtol=RTOL, atol=0)
    _same_params(run, sync_ref)


def test_receives_posted_at_their_actions_train_the_same(pp4: dict, sync_ref: dict) -> None:
    """The runs above post each peer's next two receives ahead (gloo's default); with
    ``prefetch_receives=0`` (NCCL's default) every receive is posted at its own action."""
    run = pp4["interleaved:noprefetch"]
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(sync_ref["losses"]), rtol=RTOL, atol=0)
    _same_params(run, sync_ref)


@pytest.mark.parametrize("name", ASYNC)
def test_asynchronous_schedule_matches_weight_version_reference(pp4: dict, name: str) -> None:
    ref = reference_async(name, dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(pp4[name]["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    _same_params(pp4[name], ref)


def test_weight_versions_change_the_result() -> None:
    # Guards the test above: with stale weights the result must differ from synchronous training
    # of the same (untied) model, or the references could not tell weight stashing from no stashing.
    sync = reference_sync(tied=False)
    for name in ASYNC:
        ref = reference_async(name)
        diff = max(float((ref["params"][k] - sync["params"][k]).abs().max()) for k in ref["params"])
        assert diff > 1e-4, name


def test_3d_pp2_tp2_dp2_matches_single_process(pp2_tp2_dp2: dict) -> None:
    """pp=2 × tp=2 × dp=2 (1F1B) trains like one process.

    fp32: losses and gradient norms equal single-process fp32 training. Parameters are compared in
    float64 (the same run with the model and every tensor in fp64, and a float64 reference): in
    fp32, tensor parallelism's other summation order is rounding that Adam amplifies for an element
    whose gradient nearly cancels (measured in fp32: one element of blocks.1.attn.o.weight off by
    4.7e-5, every other one within 2.2e-7, the same with or without the pipeline). In float64 that
    rounding is ~1e-16, so any difference above ``rtol`` is an error of the algorithm (measured in
    float64: parameters within 1.1e-13, losses 4e-15, gradient norms 6e-15 of the reference).
    """
    run = pp2_tp2_dp2["fp32"]
    ref = reference_sync()
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=RTOL, atol=0)
    run64, ref64 = pp2_tp2_dp2["fp64"], reference_sync(dtype=torch.float64)
    assert all(v.dtype == torch.float64 for v in run64["params"].values())
    torch.testing.assert_close(torch.tensor(run64["losses"]), torch.tensor(ref64["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(run64["grad_norms"]), torch.tensor(ref64["grad_norms"]), rtol=RTOL,
                               atol=0)
    _same_params(run64, ref64)
    # the fp64 run is not the fp32 one relabelled: its parameters differ from the fp32 reference's
    assert max(float((run64["params"][k] - ref["params"][k].double()).abs().max()) for k in ref["params"]) > 0


@pytest.mark.parametrize("name", SYNC + ASYNC)
def test_measured_trace_records_every_action(pp4: dict, name: str) -> None:
    """The trace holds one span per compute action and optimizer step of the schedule, per step,
    on the right pipeline rank, in the simulator's format; the optimizer step's parts before its
    wait (``U.norm``; ``U.stash`` where a version must be copied before the step overwrites it)
    are spans of their own."""
    from paratrain.parallel.config import ParallelConfig
    from paratrain.runtime.pipeline import schedule_for

    cfg = ParallelConfig(pp=4, microbatch=MICROBATCH, global_batch=GLOBAL_BATCH, schedule=name,
                         virtual_stages=2 if name == "interleaved" else 1)
    sched = schedule_for(cfg, STEPS)
    doc = pp4[name]["trace"]
    meta = doc["metadata"]
    assert (meta["schedule"], meta["microbatches"], meta["iterations"]) == (sched.name, sched.microbatches,
                                                                           sched.iterations)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    repeats = 1 if sched.iterations > 1 else STEPS  # async: one action list for the whole run
    for r, row in enumerate(sched.actions):
        want = Counter(str(a) for a in row if a.is_compute or a.kind.value == "U")
        got = Counter(e["name"] for e in spans if e["pid"] == r and not e["name"].startswith("U."))
        assert got == Counter({k: v * repeats for k, v in want.items()}), f"rank {r}"
        # the optimizer step's local gradient-norm pass is recorded as its own compute span
        parts = Counter(e["name"] for e in spans if e["pid"] == r and e["name"].startswith("U."))
        assert parts["U.norm"] == want["U"] * repeats, f"rank {r}"
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans if e["pid"] == r)
    if name in SYNC:  # one weight version: nothing to stash
        assert not any(e["name"] == "U.stash" for e in spans)
