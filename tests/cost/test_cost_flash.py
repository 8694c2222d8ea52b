"""Fused (flash) attention: bytes O(s·h), no s×s activations, causal work halved, MFU FLOPs unchanged."""

from __future__ import annotations

import dataclasses

import pytest

from paratrain.cost.compute import default_attention, layer_ops, op_time_split, resolve_attention
from paratrain.cost.memory import activation_bytes_per_layer
from paratrain.cost.stage import chunk_costs
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.device import resolve_device
from paratrain.spec.model import preset

GPT = preset("gpt3-13b")  # learned positions (dropout), MHA: kv = h
LLAMA = preset("llama2-7b")
A100 = resolve_device("a100-80gb")


def _attention(model, **kw):  # the one fused op, or the math core ops
    ops = layer_ops(model, **kw)
    return [o for o in ops if o.name in ("flash_attention", "attn_scores", "scale_mask", "softmax",
                                         "scale_mask_softmax", "attn_dropout", "attn_v")]


@pytest.mark.parametrize("b, t", [(1, 1), (2, 4), (4, 8)])
def test_flash_bytes_are_linear_in_the_sequence(b: int, t: int) -> None:
    """Forward: read Q, K, V, write O (e bytes each, (h/t) wide on a rank) and the fp32 log-sum-exp
    per row and head; backward: read Q, K, V, O, dO and the log-sum-exp, write dQ, dK, dV, and a
    read-modify-write of the fp32 dQ accumulator."""
    (op,) = _attention(GPT, attention="flash", microbatch=b, tp=t)
    s, h, a, e = GPT.seq, GPT.hidden, GPT.heads, 2
    tokens, hr, ar = b * s, h // t, a // t
    assert op.fwd_bytes == e * 4 * tokens * hr + 4 * b * ar * s
    assert op.bwd_bytes == e * 8 * tokens * hr + 4 * b * ar * s + 8 * tokens * hr
    # Doubling the sequence doubles the flash bytes; the math core's s×s bytes grow fourfold.
    long = dataclasses.replace(GPT, seq=2 * s, max_positions=2 * s)
    (op2,) = _attention(long, attention="flash", microbatch=b, tp=t)
    assert op2.fwd_bytes == pytest.approx(2 * op.fwd_bytes, rel=1e-12)
    math_bytes = sum(o.fwd_bytes for o in _attention(GPT, attention="math", microbatch=b, tp=t))
    math_long = sum(o.fwd_bytes for o in _attention(long, attention="math", microbatch=b, tp=t))
    assert math_long / math_bytes > 3.9


def test_flash_keeps_the_mfu_flops_and_halves_the_causal_work() -> None:
    (op,) = _attention(GPT, attention="flash")
    math_ops = _attention(GPT, attention="math")
    matmul = [o for o in math_ops if o.is_matmul]
    # MFU convention: QKᵀ and ·V over the full square, backward twice the forward.
    assert op.fwd_flops == sum(o.fwd_flops for o in matmul) == 4 * GPT.seq**2 * GPT.hidden
    assert op.bwd_flops == sum(o.bwd_flops for o in matmul)
    # Executed: causal skips half the blocks; the backward runs 5 matmuls to the forward's 2.
    assert op.exec_fwd_flops == op.fwd_flops / 2
    assert op.exec_bwd_flops == 2.5 * op.exec_fwd_flops
    # Forward time: compute-bound at attention_efficiency × tile efficiency of the s×s×d blocks.
    fwd, bwd, w = op_time_split(op, A100, "bf16")
    assert w == 0 and bwd > 2 * fwd


def test_flash_is_faster_where_the_scores_dominate() -> None:
    long = dataclasses.replace(LLAMA, seq=16384, max_positions=16384)
    t_flash = sum(sum(op_time_split(o, A100, "bf16")) for o in _attention(long, attention="flash"))
    t_math = sum(sum(op_time_split(o, A100, "bf16")) for o in _attention(long, attention="math"))
    assert t_flash < 0.5 * t_math


@pytest.mark.parametrize("model", [GPT, LLAMA])
@pytest.mark.parametrize("t, sp", [(1, False), (4, False), (4, True)])
def test_flash_activation_memory_is_selective_recompute_plus_the_log_sum_exp(model, t: int, sp: bool) -> None:
    """Korthikanti et al. 2022: selective recomputation stores everything but the attention core;
    flash stores no s×s tensor either, only the fp32 log-sum-exp (4·b·(a/t)·s bytes) more."""
    kw = dict(microbatch=2, tp=t, sequence_parallel=sp)
    flash = activation_bytes_per_layer(model, attention="flash", **kw)
    selective = activation_bytes_per_layer(model, recompute="selective", **kw)
    assert flash == selective + 4 * 2 * (model.heads // t) * model.seq
    assert activation_bytes_per_layer(model, attention="flash", recompute="selective", **kw) == flash
    # Closed form for GPT (MHA, f = 4h, 2-byte activations, dropout), t = 1: sbh·34 + 4·a·s·b.
    if model is GPT and t == 1:
        s, b, h, a = GPT.seq, 2, GPT.hidden, GPT.heads
        assert flash == s * b * h * 34 + 4 * a * s * b


def test_selective_recomputation_is_free_with_flash() -> None:
    cluster = resolve_cluster("dgx-a100")
    cfg = ParallelConfig(recompute="selective", attention="flash")
    (sel,) = chunk_costs(GPT, cluster, cfg)
    (none,) = chunk_costs(GPT, cluster, dataclasses.replace(cfg, recompute="none"))
    assert sel.recompute_s == 0
    assert sel.forward_s == none.forward_s and sel.activation_bytes == none.activation_bytes


def test_the_device_default() -> None:
    assert default_attention(A100) == "flash" == default_attention(resolve_device("h100"))
    assert default_attention(resolve_device("v100")) == "math"
    assert default_attention(resolve_device("cpu")) == "flash"  # torch's SDPA has fused CPU kernels
    assert resolve_attention(None, A100) == "flash" and resolve_attention("math", A100) == "math"
    cluster = resolve_cluster("dgx-a100")
    (default,) = chunk_costs(GPT, cluster, ParallelConfig())
    (flash,) = chunk_costs(GPT, cluster, ParallelConfig(attention="flash"))
    assert default == flash


@pytest.mark.parametrize("bad", ["fast", "FLASHY", ""])
def test_unknown_attention_is_a_config_error(bad: str) -> None:
    with pytest.raises(ConfigError) as e:
        ParallelConfig(attention=bad)
    assert e.value.field == "attention"
    with pytest.raises(ConfigError):
        resolve_attention(bad, A100)


def test_attention_ignores_case_like_the_other_choices() -> None:
    """A run document's or flag's FLASH is flash, as its schedule and recompute ignore case."""
    assert ParallelConfig(attention="FLASH").attention == "flash"
    assert ParallelConfig(attention="Math", schedule="GPIPE", recompute="Full").attention == "math"


@pytest.mark.parametrize(
    "args",
    [
        ["cost", "--model", "gpt3-1.3b"],
        ["simulate", "--model", "gpt3-1.3b", "--gpus", "8"],
        ["plan", "--model", "gpt3-1.3b", "--gpus", "8", "--global-batch", "8"],
    ],
)
def test_bad_attention_flag_is_one_line(run_cli, args: list[str]) -> None:
    from tests.conftest import assert_one_line_error

    code, _, err = run_cli(*args, "--attention", "fast")
    assert_one_line_error(code, err, "--attention", "flash")
