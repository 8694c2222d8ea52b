"""K-FAC in pipeline bubbles trains exactly like single-process K-FAC with the same refresh interval.

The fill pass (paratrain.sim.fill) places each rank's K-FAC pieces (``X:kfac.curv.<mb>``,
``X:kfac.reduce``, ``X:kfac.inv.<k>``) in the bubbles of the run's schedule; what does not fit
spills into later steps, which sets the refresh interval ``R``. The runtime runs step ``t`` as
iteration ``t % R`` with the fillers calling the pieces (paratrain.runtime.kfac). Curvature comes
from a cycle's first step and its inverses act from the next cycle's first step, so the parameters
must equal those of one process doing all the pieces at that step's optimizer step (float64,
tests/runtime/layout_harness.py: one launch of 4 processes for every layout, one of 1 process for
the references). The launch also covers K-FAC without fillers: a pipeline with the pieces at its
``U`` actions, and data parallelism alone (factors all-reduced over dp) with paratrain's
reduction and with DDP.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.runtime import forkrun

from paratrain.parallel.config import ParallelConfig
from paratrain.schedule.filled import FilledSchedule
from paratrain.schedule.ir import ActionKind
from paratrain.schedule.registry import generate
from paratrain.sim.fill import fill_kfac, fill_kfac_config, uniform_kfac_work
from paratrain.sim.timing import uniform_timing
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import from_document

pytestmark = [pytest.mark.dist, pytest.mark.slow]

RTOL, ATOL = 1e-9, 1e-12
STEPS, GLOBAL_BATCH, MICROBATCH, SEED, LR = 5, 8, 1, 3, 0.05
MODEL = {"layers": 4, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64, "dtype": "fp32", "name": "gpt-kfac"}
TRAIN = {"steps": STEPS, "seed": SEED, "lr": LR, "timeout_s": 120, "optimizer": "kfac", "kfac_damping": 1e-2,
         "data_cap_bytes": 2**18}
HARNESS = Path(__file__).with_name("layout_harness.py")

# name -> parallel layout (and train options); bubble-filled except those ending in "at-U" (pieces
# at the optimizer step, no pipeline or a pipeline without fillers)
PIPELINES: dict[str, dict[str, Any]] = {
    "1f1b-dp2": {"pp": 2, "dp": 2, "schedule": "1f1b"},
    "zb-h1-dp2": {"pp": 2, "dp": 2, "schedule": "zb-h1"},
    "1f1b-dp2-split": {"pp": 2, "dp": 2, "schedule": "1f1b"},  # kfac.curv.<mb>.<group> pieces
    "interleaved-dp2": {"pp": 2, "dp": 2, "schedule": "interleaved", "virtual_stages": 2},
    "chimera-pp4": {"pp": 4, "schedule": "chimera"},
    # the cost model's pieces, as train --fill-bubbles gets them: curvature split by layer group
    # (a micro-batch passes one of a Chimera rank's two chunks), one inversion per layer
    "chimera-pp4-cost": {"pp": 4, "schedule": "chimera"},
    "gpipe-dp2-at-U": {"pp": 2, "dp": 2, "schedule": "gpipe"},
    "dp4-at-U": {"dp": 4},
    "dp4-ddp-at-U": {"dp": 4, "dp_impl": "ddp"},
    # factors over the dp x cp ranks, each holding its tokens of every sequence (ring attention)
    "dp2-cp2-at-U": {"dp": 2, "cp": 2},
}
AT_U_REFRESH = 3


def filled(layout: dict[str, Any], split: bool = False, cost: bool = False) -> tuple[str, int]:
    """The fill pass on the layout's schedule with uniform durations: (FilledSchedule JSON, R);
    ``split``: one curvature piece per micro-batch and inversion group; ``cost``: the pieces and
    durations of the cost model on the ``cpu`` cluster (what ``train --fill-bubbles`` runs)."""
    cfg = ParallelConfig(global_batch=GLOBAL_BATCH, microbatch=MICROBATCH, **layout)
    if cost:
        fill = fill_kfac_config(from_document(MODEL), resolve_cluster("cpu", nodes=1, gpus=cfg.world_size), cfg)
        return json.dumps(fill.filled.to_dict()), fill.refresh_steps
    sched = generate(cfg.schedule, stages=cfg.pp, microbatches=cfg.num_microbatches,
                     virtual_stages=cfg.virtual_stages)
    work = uniform_kfac_work(sched, inv_groups=2)
    if split:
        work = dataclasses.replace(work, curv_parts_s=tuple({m: (d / 2, d / 2) for m, d in c.items()}
                                                            for c in work.curv_s))
    fill = fill_kfac(sched, uniform_timing(sched), work, split_curvature=split)
    return json.dumps(fill.filled.to_dict()), fill.refresh_steps


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _launch(out: Path, nproc: int, runs: list[dict[str, Any]]) -> None:
    spec = out / f"runs{nproc}.json"
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    cmd = forkrun.command(nproc, str(HARNESS), str(spec))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=_env())
    assert proc.returncode == 0, f"launch of {nproc} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def _run(name: str, parallel: dict[str, Any], **train: Any) -> dict[str, Any]:
    return {"name": name, "model": MODEL, "fp64": True, "train": {**TRAIN, **train},
            "parallel": {"global_batch": GLOBAL_BATCH, "microbatch": MICROBATCH, **parallel}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("kfac")
    refresh: dict[str, int] = {}
    docs: dict[str, str] = {}
    pipeline_runs = []
    for name, layout in PIPELINES.items():
        layout = dict(layout)
        train = {"dp_impl": layout.pop("dp_impl")} if "dp_impl" in layout else {}
        if name.endswith("at-U"):
            refresh[name] = AT_U_REFRESH
            pipeline_runs.append(_run(name, layout, kfac_refresh=AT_U_REFRESH, **train))
            continue
        doc, refresh[name] = filled(layout, split=name.endswith("split"), cost=name.endswith("cost"))
        docs[name] = doc
        extra = {"trace": str(out / f"{name}.trace.json")} if name == "1f1b-dp2" else {}
        pipeline_runs.append(_run(name, layout, kfac_refresh=refresh[name], kfac_filled=doc, **extra))
    _launch(out, 4, pipeline_runs)
    # references: one process, K-FAC with each refresh interval; and cycle 0 forever (no inverses)
    refs = [_run(f"single-R{r}", {}, kfac_refresh=r) for r in sorted(set(refresh.values()))]
    refs.append(_run("single-no-inverses", {}, kfac_refresh=100))
    _launch(out, 1, refs)
    got = {r["name"]: torch.load(out / f"{r['name']}.pt") for r in pipeline_runs + refs}
    losses = {r["name"]: [json.loads(x)["loss"] for x in (out / f"{r['name']}.jsonl").read_text().splitlines()]
              for r in pipeline_runs + refs}
    trace = json.loads((out / "1f1b-dp2.trace.json").read_text())
    return {"params": got, "losses": losses, "refresh": refresh, "trace": trace, "filled": docs}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipeline_kfac_equals_single_process_kfac(runs: dict[str, Any], name: str) -> None:
    r = runs["refresh"][name]
    assert r < STEPS, "a second cycle, whose steps use the inverses"
    ref = runs["params"][f"single-R{r}"]
    got = runs["params"][name]
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{name} {k}: {m}")
    assert runs["losses"][name] == pytest.approx(runs["losses"][f"single-R{r}"], rel=1e-10)


def test_preconditioning_changes_the_training(runs: dict[str, Any]) -> None:
    """The comparison above would also pass if K-FAC did nothing: the reference with inverses
    must differ from stepping on raw gradients throughout."""
    plain = runs["params"]["single-no-inverses"]
    for r in set(runs["refresh"].values()):
        ref = runs["params"][f"single-R{r}"]
        diff = max(float((ref[k] - plain[k]).abs().max()) for k in ref if "blocks" in k)
        assert diff > 1e-4, f"R={r}: preconditioning changed the block weights by only {diff}"


def test_fillers_ran_where_the_pass_placed_them(runs: dict[str, Any]) -> None:
    """The measured trace (data-parallel rank 0 of each pipeline rank) holds every filler of the
    iterations the steps ran, in each rank's order."""
    doc = json.loads(runs["filled"]["1f1b-dp2"])
    its = [FilledSchedule.from_dict(doc).iterations[t % doc["refresh_steps"]] for t in range(STEPS)]
    events = sorted((e for e in runs["trace"]["traceEvents"] if e.get("cat") == "filler"), key=lambda e: e["ts"])
    for rank in (0, 1):
        want = [str(a) for s in its for a in s.actions[rank] if a.kind is ActionKind.FILLER]
        assert [e["name"] for e in events if e["pid"] == rank] == want
        assert any(w.startswith("X:kfac.curv.") for w in want) and any(w.startswith("X:kfac.inv.") for w in want)


def test_split_curvature_pieces_were_used(runs: dict[str, Any]) -> None:
    doc = FilledSchedule.from_dict(json.loads(runs["filled"]["1f1b-dp2-split"]))
    tags = {a.tag for s in doc.iterations for row in s.actions for a in row if a.kind is ActionKind.FILLER}
    assert {"kfac.curv.0.0", "kfac.curv.0.1"} <= tags and "kfac.curv.0" not in tags
