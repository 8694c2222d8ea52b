"""Every collective and transfer of a real run goes through the communication layer and its log.

One 4-process launch (tests/runtime/layout_harness.py, the equivalence tests' worker) trains two
layouts in float64, each twice: plainly (no log, no table: the layer passes calls straight to
torch) and with ``comm_log`` and a tuning table that mixes two gloo process groups by message size
(``gloo_1t`` for collectives below 1 KiB and for every pipeline transfer, the run's own ``gloo``
for the rest). Checked:

* the comm log holds exactly the calls the layout implies per step and rank, derived here from the
  layout and the model (buckets, micro-batches, transfers per pipeline boundary, the tied
  embedding, gradient norm, loss), with the groups and sizes they must have;
* every row's backend is the table's choice for its (op, bytes, group size), and both backends
  carried calls;
* routing changes nothing: the mixed-backend run's losses, gradient norms and final parameters
  equal the plain run's exactly (the same sums in the same order; that the plain runs match
  single-process training is tests/runtime/test_runtime_equivalence.py's and
  test_pipeline_equivalence.py's job).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.runtime import forkrun

from paratrain.parallel.config import ParallelConfig
from paratrain.runtime.comm.log import read_comm_log
from paratrain.runtime.comm.table import table_from_dict
from paratrain.spec.model import resolve_model

pytestmark = [pytest.mark.dist, pytest.mark.slow]

HARNESS = Path(__file__).with_name("layout_harness.py")
STEPS, GLOBAL_BATCH, MICROBATCH = 2, 8, 2
TRAIN = {"steps": STEPS, "seed": 5, "lr": 3e-3, "timeout_s": 120, "bucket_bytes": 1}  # one bucket per tensor
EDGE = (1024, 2**20)  # collectives, transfers: every pipeline transfer goes to the second group
LAYOUTS = {"dp2tp2": {"dp": 2, "tp": 2}, "pp2dp2": {"pp": 2, "dp": 2, "schedule": "1f1b"}}


def _table() -> dict[str, Any]:
    ops = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv")
    return {"format": "paratrain-comm-table", "version": 1, "world_size": 4, "default_backend": "gloo",
            "backends": ["gloo", "gloo_1t"], "measurements": [],
            "choices": [c for op in ops for g in (2, 4) for c in (
                {"op": op, "group_size": g, "min_bytes": 0, "max_bytes": EDGE[op == "send_recv"], "backend": "gloo_1t"},
                {"op": op, "group_size": g, "min_bytes": EDGE[op == "send_recv"], "max_bytes": None,
                 "backend": "gloo"})]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("comm")
    table = out / "table.json"
    table.write_text(json.dumps(_table()))
    spec = []
    for name, layout in LAYOUTS.items():
        parallel = {"global_batch": GLOBAL_BATCH, "microbatch": MICROBATCH, **layout}
        spec.append({"name": f"{name}-plain", "model": "gpt-tiny", "parallel": parallel, "train": TRAIN, "fp64": True})
        spec.append({"name": f"{name}-mixed", "model": "gpt-tiny", "parallel": parallel, "fp64": True,
                     "train": {**TRAIN, "comm_log": str(out / f"{name}.comm.jsonl"), "comm_table": str(table)}})
    (out / "runs.json").write_text(json.dumps({"out": str(out), "runs": spec}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = forkrun.command(4, str(HARNESS), str(out / "runs.json"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = {}
    for r in spec:
        rows = [json.loads(line) for line in (out / f"{r['name']}.jsonl").read_text().splitlines()]
        result[r["name"]] = {"losses": [x["loss"] for x in rows], "grad_norms": [x["grad_norm"] for x in rows],
                             "params": torch.load(out / f"{r['name']}.pt")}
    for name in LAYOUTS:
        result[f"{name}-mixed"]["log"] = read_comm_log(str(out / f"{name}.comm.jsonl"))
    return result


def _per_step(log: list[dict[str, Any]], rank: int, step: int) -> Counter[str]:
    return Counter(r["purpose"] for r in log if r["rank"] == rank and r["step"] == step)


def test_dp2_tp2_log_holds_every_call_the_layout_implies(runs: dict[str, dict[str, Any]]) -> None:
    log = runs["dp2tp2-mixed"]["log"]
    cfg = ParallelConfig(global_batch=GLOBAL_BATCH, microbatch=MICROBATCH, **LAYOUTS["dp2tp2"])
    tensors = len(runs["dp2tp2-plain"]["params"])  # bucket_bytes=1: one bucket per parameter tensor, every step
    for rank in range(4):
        dp_group = [cfg.rank_of(pp=0, dp=d, tp=cfg.coords_of(rank)["tp"]) for d in range(cfg.dp)]
        for step in range(STEPS):
            assert _per_step(log, rank, step) == {"grad_bucket": tensors, "grad_norm": 1, "loss": 1}
        buckets = [r for r in log if r["rank"] == rank and r["purpose"] == "grad_bucket"]
        assert all(r["group"] == dp_group and r["axis"] == "dp" and r["async_op"] for r in buckets)
    scalars = [r for r in log if r["purpose"] in ("grad_norm", "loss")]
    assert all(r["group"] == [0, 1, 2, 3] and r["bytes"] == 8 for r in scalars)  # one fp64 scalar over the world
    assert len(log) == 4 * STEPS * (tensors + 2)  # nothing else was called


def test_pp2_dp2_log_holds_every_call_the_layout_implies(runs: dict[str, dict[str, Any]]) -> None:
    log = runs["pp2dp2-mixed"]["log"]
    spec = resolve_model("gpt-tiny")
    cfg = ParallelConfig(global_batch=GLOBAL_BATCH, microbatch=MICROBATCH, **LAYOUTS["pp2dp2"])
    m = cfg.num_microbatches  # per replica and step
    tied = 1 if spec.tied_embeddings else 0  # embedding (stage 0) and output projection (stage 1) share a tensor
    activation_bytes = MICROBATCH * spec.seq * spec.hidden * 8
    for rank in range(4):
        c = cfg.coords_of(rank)
        for step in range(STEPS):
            # one activation and one gradient per micro-batch crosses the one stage boundary, each way
            want = {"activation": m, "gradient": m, "grad_reduce": 1, "grad_norm": 1, "loss": 1}
            if tied:
                want["tied_grad"] = 1
            if step == 0:
                want["schedule_check"] = 1  # every rank holds the same schedule, asked once at set-up
            if step == STEPS - 1:
                want["final_params"] = 1  # the harness saves the final parameters
            assert _per_step(log, rank, step) == want, (rank, step)
        mine = [r for r in log if r["rank"] == rank]
        peer = cfg.rank_of(pp=1 - c["pp"], dp=c["dp"], tp=0)
        sends = [r for r in mine if r["op"] == "send"]
        recvs = [r for r in mine if r["op"] == "recv"]
        assert len(sends) == len(recvs) == m * STEPS
        assert all(r["group"] == [rank, peer] and r["bytes"] == activation_bytes and r["kind"] == "p2p"
                   for r in sends)
        assert all(r["group"] == [peer, rank] and r["bytes"] == activation_bytes for r in recvs)
        # stage 0 sends activations and receives gradients; stage 1 the other way round
        assert {r["purpose"] for r in sends} == {"activation" if c["pp"] == 0 else "gradient"}
        reduce = [r for r in mine if r["purpose"] == "grad_reduce"]
        assert all(r["group"] == [cfg.rank_of(pp=c["pp"], dp=d, tp=0) for d in range(cfg.dp)] for r in reduce)
        if tied:
            assert all(r["group"] == sorted([rank, peer]) for r in mine if r["purpose"] == "tied_grad")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_call_ran_on_the_tables_backend(runs: dict[str, dict[str, Any]], layout: str) -> None:
    table = table_from_dict(_table())
    log = runs[f"{layout}-mixed"]["log"]
    tuned = [r for r in log if r["op"] not in ("all_gather_object", "broadcast_object_list", "barrier")]
    for r in tuned:
        size = 2 if r["kind"] == "p2p" else len(r["group"])
        assert r["backend"] == table.choose(r["op"], r["bytes"], size), r
    assert {r["backend"] for r in tuned} == {"gloo", "gloo_1t"}  # both carried calls
    assert all(r["backend"] == "gloo_1t" for r in log if r["kind"] == "p2p")
    # object collectives keep to the run's own group: their pickled sizes differ between ranks
    assert all(r["backend"] == "gloo" for r in log if r["op"] == "all_gather_object")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_routing_over_two_backends_changes_nothing(runs: dict[str, dict[str, Any]], layout: str) -> None:
    plain, mixed = runs[f"{layout}-plain"], runs[f"{layout}-mixed"]
    assert mixed["losses"] == plain["losses"]
    assert mixed["grad_norms"] == plain["grad_norms"]
    assert plain["params"].keys() == mixed["params"].keys()
    for name, p in plain["params"].items():
        assert torch.equal(p, mixed["params"][name]), name


def test_log_rows_use_the_trace_clock_and_time_every_call(runs: dict[str, dict[str, Any]]) -> None:
    for layout in LAYOUTS:
        log = runs[f"{layout}-mixed"]["log"]
        assert [(r["start_s"], r["rank"]) for r in log] == sorted((r["start_s"], r["rank"]) for r in log)
        assert all(r["time_s"] >= 0 and r["start_s"] > 0 for r in log)  # after the run's origin
        # the members of a group issue the same calls with the same sizes in the same order
        sizes: dict[tuple[Any, ...], dict[int, list[int]]] = {}
        for r in log:
            if r["kind"] != "p2p" and r["purpose"] not in ("schedule_check", "final_params"):  # pickles differ
                key = (r["step"], r["purpose"], tuple(r["group"]))
                sizes.setdefault(key, {}).setdefault(r["rank"], []).append(r["bytes"])
        for key, by_rank in sizes.items():
            assert sorted(by_rank) == list(key[2]), key
            assert all(seq == by_rank[key[2][0]] for seq in by_rank.values()), key
