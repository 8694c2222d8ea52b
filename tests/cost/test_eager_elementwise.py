"""Eager PyTorch's element-wise composites in the cost model (RMSNorm in fp32, rotary embedding
through complex numbers, SwiGLU and GeGLU as two kernels), checked against an independent count: the same
code run under a dispatch mode that records every ATen kernel of the forward and of autograd's
backward, with the bytes each reads and writes."""

from __future__ import annotations

import pytest
import torch
from tests.cost.eager_composites import geglu, rmsnorm, rotary, swiglu
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from paratrain.cost.compute import layer_ops
from paratrain.spec.model import preset

# metadata-only operators: no kernel, no bytes
_VIEWS = {"view", "_unsafe_view", "reshape", "expand", "t", "transpose", "unsqueeze", "squeeze", "permute",
          "view_as_complex", "view_as_real", "flatten", "detach", "alias", "as_strided", "slice", "select",
          "_reshape_alias", "_conj"}


class KernelCount(TorchDispatchMode):
    """Kernels run, and bytes of the tensors of at least ``n`` elements they read and write
    (per-row statistics and weights are left out, as the cost model leaves them out)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.kernels, self.read, self.written = n, 0, 0, 0

    def _bytes(self, tensors: list) -> int:
        return sum(t.numel() * t.element_size() for t in tensors
                   if isinstance(t, torch.Tensor) and t.numel() * (2 if t.is_complex() else 1) >= self.n)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in _VIEWS:
            self.kernels += 1
            self.read += self._bytes(tree_flatten((args, kwargs))[0])
            self.written += self._bytes(tree_flatten(out)[0])
        return out


def _count(fn, inputs: list[torch.Tensor], n: int, mode: type[KernelCount] = KernelCount,  # noqa: ANN001
           ) -> tuple[KernelCount, KernelCount]:
    fwd = mode(n)
    with fwd:
        y = fn(*inputs)
    dy = torch.randn_like(y)
    bwd = mode(n)
    with bwd:
        y.backward(dy)
    return fwd, bwd


def _op(name: str, dtype: str, fused: bool):  # noqa: ANN202
    ops = layer_ops(preset("llama3-8b"), microbatch=1, dtype=dtype, attention="flash", fused=fused)
    return next(o for o in ops if o.name == name)


def _elements(name: str) -> int:
    m = preset("llama3-8b")
    tokens = m.seq
    return {"ln_1": tokens * m.hidden, "rotary": tokens * (m.hidden + m.num_kv_heads * m.head_dim),
            "swiglu": tokens * m.ffn_size}[name]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_eager_rmsnorm_bytes_and_kernels_are_what_autograd_runs(dtype: str) -> None:
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    t, h = 64, 32
    x = torch.randn(t, h, dtype=tdt, requires_grad=True)
    w = torch.randn(h, dtype=tdt, requires_grad=True)
    fwd, bwd = _count(rmsnorm, [x, w], t * h)
    op, n = _op("ln_1", dtype, fused=False), _elements("ln_1")
    assert op.fwd_bytes / n == pytest.approx((fwd.read + fwd.written) / (t * h))
    assert op.bwd_bytes / n == pytest.approx((bwd.read + bwd.written) / (t * h))
    assert (op.fwd_kernels, op.bwd_kernels) == (fwd.kernels, bwd.kernels)
    fused = _op("ln_1", dtype, fused=True)  # one kernel: read x, write y; dy and x, write dx
    e = tdt.itemsize
    assert (fused.fwd_bytes, fused.bwd_bytes) == (2 * n * e, 3 * n * e)
    if dtype == "bf16":  # what fusion saves on eager bf16 Llama: 36 bytes an element forward, not 4
        assert op.fwd_bytes == 9 * fused.fwd_bytes


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_eager_rotary_bytes_and_kernels_are_what_autograd_runs(dtype: str) -> None:
    tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    t, heads, d = 64, 4, 8
    x = torch.randn(t, heads, d, dtype=tdt, requires_grad=True)
    freqs = torch.polar(torch.ones(t, 1, d // 2), torch.randn(t, 1, d // 2))
    fwd, bwd = _count(rotary, [x, freqs], t * heads * d)
    op, n = _op("rotary", dtype, fused=False), _elements("rotary")
    assert op.fwd_bytes / n == pytest.approx((fwd.read + fwd.written) / (t * heads * d))
    assert op.bwd_bytes / n == pytest.approx((bwd.read + bwd.written) / (t * heads * d))
    # q and k: the composite twice
    assert (op.fwd_kernels, op.bwd_kernels) == (2 * fwd.kernels, 2 * bwd.kernels)
    fused = _op("rotary", dtype, fused=True)
    assert fused.fwd_bytes == fused.bwd_bytes == 2 * n * tdt.itemsize


@pytest.mark.parametrize("name, fn", [("swiglu", swiglu), ("geglu", geglu)])
def test_eager_gated_activation_is_activation_then_product(name: str, fn) -> None:  # noqa: ANN001
    t, f = 64, 32
    gate = torch.randn(t, f, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(t, f, dtype=torch.bfloat16, requires_grad=True)
    fwd, bwd = _count(fn, [gate, up], t * f)
    m = preset("llama3-8b").with_overrides(activation=name)
    op = next(o for o in layer_ops(m, microbatch=1, dtype="bf16", attention="flash", fused=False) if o.name == name)
    n = _elements("swiglu")
    assert op.fwd_bytes / n == pytest.approx((fwd.read + fwd.written) / (t * f))
    assert op.bwd_bytes / n == pytest.approx((bwd.read + bwd.written) / (t * f))
    assert (op.fwd_kernels, op.bwd_kernels) == (fwd.kernels, bwd.kernels)


class ElementwiseCount(KernelCount):
    """:class:`KernelCount` without the GEMMs (the cost model's GEMM operators count those)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket.__name__ in ("addmm", "mm"):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_eager_gpt_layer_adds_its_biases_inside_the_gemms() -> None:
    """``nn.Linear`` with a bias is one ``addmm``: the GeLU and the residual add run alone, and the
    backward reduces the output gradient over the tokens for the bias (what the runtime's GPT
    runs, without dropout)."""
    import dataclasses

    import torch.nn.functional as F

    t, h, f = 64, 32, 128
    x = torch.randn(t, h, requires_grad=True)
    w1, b1 = torch.randn(f, h, requires_grad=True), torch.randn(f, requires_grad=True)
    fwd, bwd = _count(lambda x: F.gelu(F.linear(x, w1, b1), approximate="tanh"), [x], t * f, ElementwiseCount)
    tiny = dataclasses.replace(preset("gpt-tiny"), hidden=h, ffn=f, seq=t)  # fp32, bias, no dropout
    ops = {o.name: o for o in layer_ops(tiny, microbatch=1, attention="flash", fused=False)}
    assert "fc1_bias" not in ops and ops["gelu"].kind == "activation"
    assert ops["gelu"].fwd_bytes == fwd.read + fwd.written  # 1 kernel: read x, write y
    assert ops["gelu"].bwd_bytes == bwd.read + bwd.written  # gelu_backward, then the bias gradient's sum
    assert (ops["gelu"].fwd_kernels, ops["gelu"].bwd_kernels) == (fwd.kernels, bwd.kernels) == (1, 2)

    # the residual stream's gradient passes through the add (no kernel; a leaf would add a copy)
    a, res = torch.randn(t, f, requires_grad=True), torch.randn(t, h)
    w2, b2 = torch.randn(h, f, requires_grad=True), torch.randn(h, requires_grad=True)
    fwd, bwd = _count(lambda a, res: res + F.linear(a, w2, b2), [a, res], t * h, ElementwiseCount)
    op = ops["mlp_residual"]
    assert op.fwd_bytes == fwd.read + fwd.written  # the add: two tensors in, one out
    assert op.bwd_bytes == bwd.read + bwd.written  # the bias gradient reads dy
    assert (op.fwd_kernels, op.bwd_kernels) == (fwd.kernels, bwd.kernels) == (1, 1)


def test_dropout_is_a_kernel_and_a_mask_of_its_own_when_eager() -> None:
    """With dropout (GPT-3's default), eager PyTorch on a GPU runs ``native_dropout``: one kernel
    reading x and writing y and a one-byte mask, then the add; Megatron's fused bias-dropout-add
    is one kernel. Without it, eager and fused move the same bytes."""
    import dataclasses

    gpt = preset("gpt3-1.3b")
    n, e = gpt.seq * gpt.hidden, 2

    def residual(model, fused: bool):  # noqa: ANN001, ANN202
        ops = layer_ops(model, microbatch=1, attention="flash", fused=fused)
        return next(o for o in ops if o.name == "attn_residual")

    eager, fused = residual(gpt, False), residual(gpt, True)
    assert gpt.uses_dropout
    assert eager.fwd_bytes == (1 + 1) * n * e + n + (2 + 1) * n * e  # dropout r1 w1 + mask, add r2 w1
    assert fused.fwd_bytes == 3 * n * e + n  # one kernel: x and the residual in, the sum and the mask out
    assert (eager.fwd_kernels, fused.fwd_kernels) == (2, 1)
    # backward: the mask applied to dy (read dy and the mask, write dx), the bias gradient reads dy
    assert eager.bwd_bytes == fused.bwd_bytes == (1 + 1 + 1) * n * e + n
    assert (eager.bwd_kernels, fused.bwd_kernels) == (2, 1)  # fused: one kernel, as calibrated
    plain = dataclasses.replace(gpt, dropout=False)
    assert residual(plain, False).fwd_bytes == residual(plain, True).fwd_bytes == 3 * n * e
    assert residual(plain, False).bwd_bytes == n * e


def test_models_without_rotary_or_rmsnorm_are_unchanged_by_eager_kernels() -> None:
    gpt = preset("gpt3-1.3b")  # LayerNorm (one native kernel either way), learned positions, GeLU
    eager = {o.name: o for o in layer_ops(gpt, microbatch=1, attention="flash", fused=False)}
    fused = {o.name: o for o in layer_ops(gpt, microbatch=1, attention="flash", fused=True)}
    assert "rotary" not in eager
    assert eager["ln_1"] == fused["ln_1"]


def test_alibi_models_have_no_rotary_kernels_no_position_table_and_no_runtime() -> None:
    """MPT's ALiBi is a bias inside the attention kernel: no rotary op, no learned positions; the
    runtime's models do not implement it and say so."""
    import dataclasses

    from paratrain.errors import ConfigError
    from paratrain.runtime.models import build_model
    from paratrain.spec.model import Position

    llama = preset("llama3-8b")
    alibi = dataclasses.replace(llama, position=Position.ALIBI)
    names = [o.name for o in layer_ops(alibi, microbatch=1, attention="flash", fused=False)]
    assert "rotary" in [o.name for o in layer_ops(llama, microbatch=1, attention="flash")]
    assert "rotary" not in names
    assert alibi.num_positions == 0 and alibi.param_count() == llama.param_count()
    tiny = dataclasses.replace(alibi, layers=1, hidden=16, heads=2, kv_heads=2, ffn=32, seq=8, vocab=32)
    with pytest.raises(ConfigError, match="alibi"):
        build_model(tiny, seed=0)
