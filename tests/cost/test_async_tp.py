"""Tensor-parallel overlap (``--tp-overlap async|userbuffers``): the fused collective-GEMM closed
form, a layer's exposed collectives in the comm-bound and the comm-free limits, which passes each
flavour overlaps, the public runs that used it, and bad input."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.cli import main
from paratrain.cost.async_tp import decomposed_gemm_s, fused_exposed_s
from paratrain.cost.compute import layer_ops, op_time_split
from paratrain.cost.gemm import gemm_efficiency, gemm_peak_flops
from paratrain.cost.stage import chunk_costs
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.plan.publicruns import parse_public_runs
from paratrain.runtime.config import train_refusal
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import resolve_model

TP = 8
MODEL = dataclasses.replace(resolve_model("llama3-8b"), layers=2)
ACT = 1 * MODEL.seq * MODEL.hidden * 2  # one micro-batch's bf16 activation: what each SP collective moves


def _cluster(collective_s: float):
    """A DGX H100 whose tensor-parallel all-gathers and reduce-scatters of ``ACT`` take exactly
    ``collective_s`` (one measured point per kind)."""
    base = resolve_cluster("dgx-h100", gpus=TP)
    rows = (("all_gather", TP, ACT, collective_s), ("reduce_scatter", TP, ACT, collective_s))
    return dataclasses.replace(base, measured_collectives=rows)


def _layer_tp_s(cluster, overlap: str) -> tuple[float, float]:
    """How much ``overlap`` changes one layer's (forward, input-gradient backward) time against no
    overlap: the difference of a two-layer and a one-layer model (embedding and head cancel)."""

    def per_layer(o: str) -> tuple[float, float]:
        cfg = ParallelConfig(tp=TP, sequence_parallel=True, tp_overlap=o)
        (two,) = chunk_costs(MODEL, cluster, cfg)
        (one,) = chunk_costs(dataclasses.replace(MODEL, layers=1), cluster, cfg)
        return two.forward_s - one.forward_s, two.backward_input_s - one.backward_input_s

    (f, b), (f0, b0) = per_layer(overlap), per_layer("none")
    return f - f0, b - b0


def _gemms(cluster) -> dict[str, tuple[float, float, float, float]]:
    """name -> (forward, input gradient, decomposed forward, decomposed input gradient)."""
    ops = layer_ops(MODEL, tp=TP, sequence_parallel=True, microbatch=1, dtype="bf16", attention="flash")
    out = {}
    for op in ops:
        if op.name in ("qkv", "attn_proj", "fc1", "fc2") and op.gemm is not None:
            f, bi, _ = op_time_split(op, cluster.device, "bf16")
            df, dbi = decomposed_gemm_s(op, TP, cluster.device, "bf16")
            out[op.name] = (f, bi, df, dbi)
    return out


# ----- the closed form ----------------------------------------------------------------------------
def test_a_fused_collective_adds_what_the_gemm_pieces_cannot_hide():
    # 8 pieces: 7/8 of the GEMM runs while the collective travels
    assert fused_exposed_s(1.0, 0.8, 8) == pytest.approx(1.0 - 0.7)
    assert fused_exposed_s(0.5, 0.8, 8) == 0.0  # 0.5 < 0.7: hidden
    assert fused_exposed_s(0.4, 0.8, 2) == 0.0 and fused_exposed_s(0.5, 0.8, 2) == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="tp is 1"):
        fused_exposed_s(1.0, 1.0, 1)
    with pytest.raises(ConfigError, match="negative"):
        fused_exposed_s(-1.0, 1.0, 4)


def test_decomposed_gemms_have_the_same_flops_in_tp_row_blocks():
    # tp GEMMs of m/tp rows: together the whole GEMM's 2·m·n·k FLOPs, each piece on the roofline of
    # its own shape (its tile and wave efficiency, bf16 inputs and output, one kernel launch)
    dev = _cluster(1e-3).device
    peak = gemm_peak_flops(dev, "bf16")
    ops = layer_ops(MODEL, tp=TP, sequence_parallel=True, microbatch=1, dtype="bf16", attention="flash")
    gemms = [op for op in ops if op.name in ("qkv", "attn_proj", "fc1", "fc2")]
    assert len(gemms) == 4
    for op in gemms:
        m, n, k = op.gemm
        rows = m // TP
        assert rows * TP == m == MODEL.seq  # one micro-batch's tokens, split evenly
        piece_flops = 2.0 * rows * n * k
        assert TP * piece_flops == op.fwd_flops
        piece_bytes = 2.0 * (rows * k + k * n + rows * n)

        def roofline(eff: float, flops: float = piece_flops, nbytes: float = piece_bytes) -> float:
            memory = nbytes / (dev.memory_bandwidth_Bps * dev.memory_efficiency)
            return max(flops / (peak * eff), memory) + dev.kernel_overhead_s

        df, dbi = decomposed_gemm_s(op, TP, dev, "bf16")
        assert df == pytest.approx(TP * roofline(gemm_efficiency(rows, n, k, dev)), rel=1e-12), op.name
        # the input gradient dA = dC·Bᵀ of a piece: an (m/tp, k, n) GEMM
        assert dbi == pytest.approx(TP * roofline(gemm_efficiency(rows, k, n, dev)), rel=1e-12), op.name


# ----- a layer, in the limits ---------------------------------------------------------------------
def test_comm_bound_layer_keeps_the_collective_less_seven_eighths_of_each_gemm():
    t = 1.0  # each collective far longer than any GEMM
    cluster = _cluster(t)
    g = _gemms(cluster)
    fwd_delta, bwd_delta = _layer_tp_s(cluster, "async")
    # no overlap: 2 all-gathers + 2 reduce-scatters of t; async: each less 7/8 of its decomposed
    # GEMM, plus what the decomposition costs that GEMM
    exposed = sum(t - g[n][2] * (TP - 1) / TP + max(0.0, g[n][2] - g[n][0]) for n in ("qkv", "attn_proj", "fc1", "fc2"))
    assert fwd_delta == pytest.approx(exposed - 4 * t, rel=1e-9)
    assert bwd_delta == pytest.approx(0.0, abs=1e-12)  # torch's async TP: the forward's only
    fwd_ub, bwd_ub = _layer_tp_s(cluster, "userbuffers")
    assert fwd_ub == pytest.approx(fwd_delta, rel=1e-12)
    exposed_bwd = sum(t - g[n][3] * (TP - 1) / TP + max(0.0, g[n][3] - g[n][1])
                      for n in ("fc2", "fc1", "attn_proj", "qkv"))
    assert bwd_ub == pytest.approx(exposed_bwd - 4 * t, rel=1e-9)


def test_free_collectives_leave_only_the_decomposition():
    cluster = _cluster(0.0)
    g = _gemms(cluster)
    fwd_delta, _ = _layer_tp_s(cluster, "async")
    assert fwd_delta == pytest.approx(sum(max(0.0, g[n][2] - g[n][0]) for n in g), abs=1e-12)


def test_overlap_shortens_a_70b_step_on_h100():
    model = resolve_model("llama3-70b")
    cluster = resolve_cluster("dgx-h100", gpus=64)
    times = {}
    for overlap in ("none", "async", "userbuffers"):
        cfg = ParallelConfig(dp=8, tp=8, global_batch=64, sequence_parallel=True, recompute="full", tp_overlap=overlap)
        (c,) = chunk_costs(model, cluster, cfg)
        times[overlap] = (c.forward_s + c.backward_s, c.tp_comm_s)
    assert times["userbuffers"][0] < times["async"][0] < times["none"][0]
    assert times["userbuffers"][1] < times["async"][1] < times["none"][1]


# ----- which public runs overlap ------------------------------------------------------------------
def test_public_runs_that_overlapped_their_tp_collectives():
    from paratrain.data import DATA_DIR

    path = DATA_DIR / "publicruns" / "h100_a100_public_runs.csv"
    runs = parse_public_runs(path.read_text(encoding="utf-8"), path.name).runs
    by = {r.line: r.tp_overlap for r in runs}
    assert {line for line, o in by.items() if o == "async"} == {9, 15, 17}  # torchtitan's "async TP" rows
    assert {line for line, o in by.items() if o == "userbuffers"} == {28, 32, 33}  # NVIDIA's recipes
    assert by[14] == by[16] == "none"  # the same pages' vanilla-TP rows


# ----- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(tp=2, sequence_parallel=True, tp_overlap="ring"), "unknown tensor-parallel overlap"),
    (dict(tp=1, tp_overlap="async"), "tp is 1"),
    (dict(tp=2, tp_overlap="userbuffers"), "sequence parallelism is off"),
])
def test_bad_overlap_settings_are_one_line_errors(kw, match):
    with pytest.raises(ConfigError, match=match) as e:
        ParallelConfig(**kw)
    assert e.value.field == "tp_overlap"


def _exit_code(argv) -> int:
    try:
        main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_cli_names_the_flag_and_train_refuses(capsys):
    args = ["simulate", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "8", "--tp", "8",
            "--global-batch", "8", "--tp-overlap", "async"]
    assert _exit_code(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("paratrain: error: --tp-overlap:") and "sequence parallelism" in err and "\n" not in err
    assert _exit_code([*args, "--sequence-parallel", "--json"]) == 0
    capsys.readouterr()
    # the CPU runtime's DTensor collectives run unfused: nothing to overlap there
    assert _exit_code(["simulate", "--model", "gpt-tiny", "--cluster", "cpu", "--tp", "2", "--sequence-parallel",
                       "--tp-overlap", "async"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("paratrain: error: --tp-overlap:") and "\n" not in err
    refusal = train_refusal(MODEL, ParallelConfig(tp=2, sequence_parallel=True, tp_overlap="async"))
    assert refusal is not None and refusal.startswith("--tp-overlap:")
