"""Sharded data parallelism levels (none, zero1, zero2, zero3): the config field, the memory and
time each costs, the planner's choice, and the flags.

Memory per rank, closed form (ZeRO, Rajbhandari et al. 2020, sec. 5.1 and fig. 1, with Ψ
parameters, 2 bytes each of bf16 weights and gradients, K = 12 bytes of Adam state, N_d ranks):
none 16Ψ; zero1 4Ψ + 12Ψ/N_d; zero2 and zero3 16Ψ/N_d between steps, plus what the step gathers.
"""

from __future__ import annotations

import json
import time

import pytest

from paratrain.cli import main
from paratrain.cost.sharding import ShardedUnit, fsdp_microbatch_s, fsdp_phases_s
from paratrain.cost.stage import chunk_costs
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import resolve_model

GPT = resolve_model("gpt3-125m")  # tied embeddings: one chunk holds Ψ = GPT.param_count() parameters
CLUSTER = resolve_cluster("dgx-a100", nodes=1)


def _cfg(level: str, dp: int = 4, **kw: object) -> ParallelConfig:
    return ParallelConfig(dp=dp, sharding=level, global_batch=kw.pop("global_batch", dp), **kw)  # type: ignore[arg-type]


# ----- the config field ------------------------------------------------------------------------

@pytest.mark.parametrize("given, level", [
    ({}, "none"), ({"sharding": "zero1"}, "zero1"), ({"sharding": "ZeRO-3"}, "zero3"), ({"sharding": "fsdp"}, "zero3"),
    # the former switch: true is what the runtime ran, FSDP2 with reshard_after_forward=False
    ({"optimizer_sharding": True}, "zero2"), ({"optimizer_sharding": False}, "none"),
    ({"optimizer_sharding": False, "sharding": "zero3"}, "zero3"),
])
def test_levels_and_the_former_switch(given: dict[str, object], level: str) -> None:
    cfg = ParallelConfig(dp=2, **given)  # type: ignore[arg-type]
    assert cfg.sharding == level
    assert cfg.optimizer_sharding == (level != "none")
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg  # what plan -o writes reads back


def test_overrides_keep_level_and_switch_together() -> None:
    z3 = _cfg("zero3")
    assert z3.with_overrides(optimizer_sharding=False).sharding == "none"
    assert z3.with_overrides(optimizer_sharding=True).sharding == "zero3"  # already sharded: kept
    assert _cfg("none").with_overrides(optimizer_sharding=True).sharding == "zero2"
    assert z3.with_overrides(sharding="zero1").optimizer_sharding


@pytest.mark.parametrize("doc", [{"sharding": "zero4"}, {"sharding": 3}, {"sharding": None},
                                 {"optimizer_sharding": True, "sharding": "none"},
                                 {"optimizer_sharding": False, "sharding": "zero2"}])
def test_bad_levels_are_config_errors(doc: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as e:
        ParallelConfig.from_dict({"dp": 2, **doc})
    assert "sharding" in e.value.field


# ----- memory ----------------------------------------------------------------------------------

def _unit_params() -> int:
    """The largest FSDP unit of GPT-3 125M: the word and position embeddings (V·h + s·h) beat a
    layer (12h² + 13h) and the final norm (2h)."""
    h, v, s = GPT.hidden, GPT.vocab, GPT.seq
    layer = 12 * h * h + 13 * h
    emb = v * h + s * h
    assert emb > layer
    return emb


@pytest.mark.parametrize("dp", [2, 8])
def test_memory_per_level_in_closed_form(dp: int) -> None:
    psi = GPT.param_count()
    (none,) = chunk_costs(GPT, CLUSTER, _cfg("none", dp))
    (z1,) = chunk_costs(GPT, CLUSTER, _cfg("zero1", dp))
    (z2,) = chunk_costs(GPT, CLUSTER, _cfg("zero2", dp))
    (z3,) = chunk_costs(GPT, CLUSTER, _cfg("zero3", dp))

    def shard(n: int) -> int:
        return -(-n // dp)

    # Megatron's buffer keeps bf16 models' gradients in fp32 (cost.memory.grad_dtype_bytes)
    assert (none.weight_bytes, none.grad_bytes, none.optimizer_bytes) == (2 * psi, 4 * psi, 12 * psi)
    assert (z1.weight_bytes, z1.grad_bytes, z1.optimizer_bytes) == (2 * psi, 4 * psi, shard(12 * psi))
    for z in (z2, z3):
        assert (z.weight_bytes, z.grad_bytes, z.optimizer_bytes) == (shard(2 * psi), shard(4 * psi), shard(12 * psi))
    unit = 2 * _unit_params()
    # zero2: the whole model gathered for the step, and one unit's unsharded gradient
    assert z2.transient_bytes - none.transient_bytes == 2 * psi + unit
    # zero3: the unit computing and the one prefetched, and one unit's unsharded gradient
    assert z3.transient_bytes - none.transient_bytes == 3 * unit
    assert none.transient_bytes == z1.transient_bytes


def test_zero2_gathers_every_chunk_a_rank_holds() -> None:
    """Interleaved, 2 chunks per rank: each rank keeps both its chunks' parameters gathered."""
    model = resolve_model("gpt3-125m", layers=8)
    cfg = ParallelConfig(dp=2, pp=2, schedule="interleaved", virtual_stages=2, global_batch=8, sharding="zero2")
    z2 = chunk_costs(model, CLUSTER, cfg)
    base = chunk_costs(model, CLUSTER, cfg.with_overrides(sharding="zero1"))
    full = [c.grad_reduce_bytes for c in base]  # bf16 bytes of each chunk's (unsharded) parameters
    h, v, s = model.hidden, model.vocab, model.seq
    # plus the unsharded bf16 gradient of the chunk's largest unit: on chunk 0 the word and position
    # embeddings; on the last chunk the head (the final norm's 2h and, the embeddings being tied,
    # the last stage's own copy of the word embeddings); a layer (12h² + 13h) in between
    largest = [(v + s) * h, 12 * h * h + 13 * h, 12 * h * h + 13 * h, v * h + 2 * h]
    for k, (a, b) in enumerate(zip(z2, base, strict=True)):
        rank_weight = full[k % 2] + full[k % 2 + 2]
        assert a.transient_bytes - b.transient_bytes - rank_weight == 2 * largest[k], k


def test_one_rank_shards_nothing() -> None:
    ref = chunk_costs(GPT, CLUSTER, _cfg("none", 1))
    for level in ("zero1", "zero2", "zero3"):
        assert chunk_costs(GPT, CLUSTER, _cfg(level, 1)) == ref


# ----- time ------------------------------------------------------------------------------------

def test_two_units_by_hand() -> None:
    """u1 computes 1 s forward / 2 s backward, gathers in 0.5 s, reduce-scatters in 0.7 s; u2
    gathers slowly (3 s), reduce-scatters in 0.4 s.

    Forward: gather u1 (0.5), then u1's forward under u2's gather (max(1, 3) = 3), then u2 (1): 4.5.
    Backward, zero3: re-gather u2 (3), u2's backward under u1's re-gather (max(2, 0.5) = 2), u1's
    under u2's reduce-scatter (max(2, 0.4) = 2), u1's reduce-scatter (0.7): 7.7.
    Backward, zero2: nothing to re-gather: 2 + 2 + 0.7 = 4.7."""
    u = [ShardedUnit(1.0, 2.0, 0.5, 0.7), ShardedUnit(1.0, 2.0, 3.0, 0.4)]
    assert fsdp_phases_s(u, reshard_after_forward=True) == pytest.approx((4.5, 7.7))
    assert fsdp_phases_s(u, reshard_after_forward=False) == pytest.approx((4.5, 4.7))
    total, exposed = fsdp_microbatch_s(u, reshard_after_forward=True)
    assert (total, exposed) == pytest.approx((12.2, 12.2 - 6.0))


def test_three_units_by_hand() -> None:
    """Three equal units, 1 s forward, 2 s backward, 1.5 s gather, 2.5 s reduce-scatter.

    Forward: 1.5 + max(1, 1.5) + max(1, 1.5) + 1 = 5.5.
    Backward, zero3: 1.5 + max(2, 1.5) + max(2, 1.5 + 2.5) + max(2, 2.5) + 2.5 = 12.5.
    Backward, zero2: 0 + 2 + max(2, 2.5) + max(2, 2.5) + 2.5 = 9.5."""
    u = [ShardedUnit(1.0, 2.0, 1.5, 2.5)] * 3
    assert fsdp_phases_s(u, reshard_after_forward=True) == pytest.approx((5.5, 12.5))
    assert fsdp_phases_s(u, reshard_after_forward=False) == pytest.approx((5.5, 9.5))


def test_each_unit_prefetches_the_next_ones_gather() -> None:
    """Three different units (the examples above cannot tell the next unit from the previous: two
    units, or three alike): 1 s forward, 2 s backward each; gathers 0.5, 3 and 1.5 s; reduce-scatters
    0.7, 0.4 and 0.2 s.

    Forward: gather u1 (0.5), u1 under u2's gather (max(1, 3) = 3), u2 under u3's (max(1, 1.5) = 1.5),
    u3 (1): 6.
    Backward, zero3: re-gather u3 (1.5), u3 under u2's re-gather (max(2, 3) = 3), u2 under u1's
    re-gather and u3's reduce-scatter (max(2, 0.5 + 0.2) = 2), u1 under u2's reduce-scatter
    (max(2, 0.4) = 2), u1's reduce-scatter (0.7): 9.2.
    Backward, zero2: 2 + max(2, 0.2) + max(2, 0.4) + 0.7 = 6.7."""
    u = [ShardedUnit(1.0, 2.0, 0.5, 0.7), ShardedUnit(1.0, 2.0, 3.0, 0.4), ShardedUnit(1.0, 2.0, 1.5, 0.2)]
    assert fsdp_phases_s(u, reshard_after_forward=True) == pytest.approx((6.0, 9.2))
    assert fsdp_phases_s(u, reshard_after_forward=False) == pytest.approx((6.0, 6.7))


def test_levels_order_their_per_microbatch_time() -> None:
    """Over nodes (dp 16 on two DGX nodes): zero2 and zero3 gather alike in the forward; zero3
    gathers again in the backward; zero1 and none add nothing inside a micro-batch."""
    cluster = resolve_cluster("dgx-a100", nodes=2)
    (none,) = chunk_costs(GPT, cluster, _cfg("none", 16))
    (z1,) = chunk_costs(GPT, cluster, _cfg("zero1", 16))
    (z2,) = chunk_costs(GPT, cluster, _cfg("zero2", 16))
    (z3,) = chunk_costs(GPT, cluster, _cfg("zero3", 16))
    assert (z1.forward_s, z1.backward_s) == (none.forward_s, none.backward_s)
    assert z2.forward_s == z3.forward_s > none.forward_s
    assert z3.backward_s > z2.backward_s > none.backward_s


def test_fsdp_repeats_every_microbatch() -> None:
    """zero3's extra time over none grows by the same amount per micro-batch (each one gathers and
    reduce-scatters), while none's step-end all-reduce is paid once: the difference is linear in
    the micro-batch count."""
    from paratrain.sim import simulate_config

    cluster = resolve_cluster("dgx-a100", nodes=2)

    def gap(m: int) -> float:
        t = {lv: simulate_config(GPT, cluster, _cfg(lv, 16, global_batch=16 * m)).iteration_time_s
             for lv in ("none", "zero3")}
        return t["zero3"] - t["none"]

    g2, g4, g8 = gap(2), gap(4), gap(8)
    assert g8 - g4 == pytest.approx(2 * (g4 - g2), rel=1e-6)
    # grows per micro-batch; at 2 the unsharded step's fp32 gradient pass can outweigh it
    assert g8 > g4 > g2 and g8 > 0


# ----- the planner ---------------------------------------------------------------------------

BIG = resolve_model("gpt3-13b", layers=48, hidden=6144, heads=48)  # 21.8B parameters


def test_planner_shards_parameters_when_memory_forces_it() -> None:
    """21.8B parameters on 8 A100-80GB, dp 8 pinned: none (16Ψ = 349 GB), zero1 (5.5Ψ = 120 GB) and
    zero2 (4Ψ = 87 GB) exceed the 76 GB usable, zero3 (2Ψ = 44 GB) fits."""
    from paratrain.plan.search import plan
    from paratrain.plan.space import Pins

    cluster = resolve_cluster("dgx-a100", gpus=8)
    pins = Pins(dp=8, tp=1, pp=1, microbatch=1, recompute="full")
    result = plan(BIG, cluster, 64, pins=pins, top=3, confirm=1)
    assert result.winner.config.sharding == "zero3"
    assert {c.config.sharding for c in result.ranked} == {"zero3"}
    with pytest.raises(ConfigError):
        plan(BIG, cluster, 64, pins=Pins(dp=8, tp=1, pp=1, microbatch=1, recompute="full", sharding="zero2"),
             top=1, confirm=1)


# ----- the flags -------------------------------------------------------------------------------

def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


SIM = ["simulate", "--model", "gpt-tiny", "--gpus", "4", "--dp", "4", "--global-batch", "8"]


def test_simulate_and_plan_report_the_level(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, [*SIM, "--sharding", "fsdp", "--json"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["sharding"] == doc["config"]["sharding"] == "zero3"
    code, out, err = _run(capsys, [*SIM, "--optimizer-sharding", "--json"])
    assert json.loads(out)["sharding"] == "zero2"
    code, out, err = _run(capsys, ["plan", "--model", "gpt3-125m", "--cluster", "dgx-a100", "--gpus", "8",
                                   "--global-batch", "64", "--dp", "8", "--sharding", "zero1", "--no-simulate",
                                   "--json"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["sharding"] == "zero1"
    assert {c["parallel"]["sharding"] for c in doc["candidates"]} == {"zero1"}


BAD = [
    ("unknown-level", [*SIM, "--sharding", "zero4"], "unknown sharding level"),
    ("contradicting-flags", [*SIM, "--sharding", "zero3", "--no-optimizer-sharding"], "--sharding"),
    ("plan-unknown-level", ["plan", "--model", "gpt-tiny", "--gpus", "4", "--global-batch", "8", "--sharding", "z"],
     "sharding"),
    ("train-zero1-fsdp", ["train", "--model", "gpt-tiny", "--dp", "2", "--nproc", "2", "--sharding", "zero1",
                          "--dp-impl", "fsdp"], "--dp-impl paratrain"),
    ("train-fsdp-2bw", ["train", "--model", "gpt-tiny", "--dp", "2", "--pp", "2", "--nproc", "4", "--sharding", "zero3",
                        "--schedule", "2bw"], "FSDP2"),
    ("train-zero1-kfac", ["train", "--model", "gpt-tiny", "--dp", "2", "--nproc", "2", "--sharding", "zero1",
                          "--optimizer", "kfac"], "--optimizer"),
    ("train-zero3-paratrain-dp", ["train", "--model", "gpt-tiny", "--dp", "2", "--nproc", "2", "--sharding", "zero3",
                                  "--dp-impl", "paratrain"], "--dp-impl"),
]


@pytest.mark.parametrize("argv, needle", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_sharding_input_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str],
                                               needle: str) -> None:
    t0 = time.monotonic()
    code, out, err = _run(capsys, argv)
    lines = err.strip().splitlines()
    assert code == 2, (code, out[-500:], err[-2000:])
    assert len(lines) == 1 and lines[0].startswith("paratrain: error: ") and "fix:" in lines[0], err
    assert needle in lines[0], lines[0]
    assert time.monotonic() - t0 < 5.0


# ----- the public runs: pipelines under FSDP ---------------------------------------------------

def test_pipeline_under_fsdp_is_predicted_once_its_microbatch_is_known() -> None:
    """Llama 3 405B on 8,192 H100 (TP 8, PP 16, FSDP 64 keeping parameters gathered: zero2) is
    skipped only for its unpublished micro-batch; given one, the simulator predicts it with FSDP
    inside each stage, slower than the same pipeline under plain data parallelism."""
    import csv
    import dataclasses
    import io

    from paratrain.data import DATA_DIR
    from paratrain.plan.publicruns import parse_public_runs, predict_step_s, public_clusters, run_cluster, run_config

    text = (DATA_DIR / "publicruns" / "h100_a100_public_runs.csv").read_text(encoding="utf-8")
    rows = list(csv.DictReader(io.StringIO(text)))
    row = next(r for r in rows if "Llama 3 Herd" in r["source"] and r["dp"] == "64")
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=list(rows[0].keys()))
    w.writeheader()
    w.writerow({**row, "microbatch": "1"})
    (run,) = parse_public_runs(out.getvalue()).runs
    assert (run.pp, run.sharding, run_config(run).sharding) == (16, "zero2", "zero2")
    cluster = run_cluster(run, public_clusters())
    fsdp = predict_step_s(run, cluster)
    ddp = predict_step_s(dataclasses.replace(run, sharding="ddp"), cluster)
    assert 0 < ddp < fsdp < 10 * ddp


def test_zb_h1_under_fsdp_keeps_unsharded_gradients_as_the_runtime_does():
    """ZB-H1's weight pass comes after its input pass: the runtime's FSDP2 holds a chunk's
    unsharded gradients until R (runtime/pipeline_engine.py), so the chunk's gradient memory is
    zero1's (unsharded), its parameters and optimizer state stay sharded."""

    model, cluster = resolve_model("gpt3-1.3b"), resolve_cluster("dgx-a100", gpus=8)

    def costs(level: str, schedule: str):
        return chunk_costs(model, cluster, ParallelConfig(dp=4, pp=2, global_batch=16, sharding=level,
                                                          schedule=schedule))

    for level in ("zero2", "zero3"):
        held, flushed, zero1 = costs(level, "zb-h1"), costs(level, "1f1b"), costs("zero1", "zb-h1")
        for h, f, z in zip(held, flushed, zero1, strict=True):
            assert h.grad_bytes == z.grad_bytes > f.grad_bytes  # unsharded, not dp-sharded
            assert h.weight_bytes == f.weight_bytes < z.weight_bytes and h.optimizer_bytes == f.optimizer_bytes
