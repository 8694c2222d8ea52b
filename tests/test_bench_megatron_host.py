"""The Megatron-DeepSpeed layer whose host time sets the A100's host-issue prior: it is a GPT layer
(same output as an independent float64 formula), full recomputation gives the same gradients as
none, the measurement runs and writes its figures, and the prior is that figure over the 45 kernels
the cost model issues for such a layer."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
import torch.nn.functional as F

from paratrain.cost.compute import layer_ops, op_kernels
from paratrain.spec.model import ModelSpec
from tests.scripts import load_script

bench = load_script("bench/bench_megatron_host.py", "bench_megatron_host")


def _reference(layer, h: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """A pre-norm GPT layer written out (no dropout, unmasked attention), activations [s, b, h]."""
    s, b, hidden = h.shape
    n, d = layer.heads, layer.head_dim
    x = F.layer_norm(h, (hidden,), layer.input_norm.weight, layer.input_norm.bias, layer.input_norm.eps)
    qkv = (x @ layer.qkv.weight.T + layer.qkv.bias).view(s, b, n, 3, d)  # Megatron's per-head [q k v]
    q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))  # [b, n, s, d]
    ctx = F.scaled_dot_product_attention(q, k, v).permute(2, 0, 1, 3).reshape(s, b, hidden)
    h = h + ctx @ layer.dense.weight.T + layer.dense.bias
    y = F.layer_norm(h, (hidden,), layer.post_norm.weight, layer.post_norm.bias, layer.post_norm.eps)
    y = F.gelu(y @ layer.fc1.weight.T + layer.fc1.bias, approximate="tanh")
    return h + y @ layer.fc2.weight.T + layer.fc2.bias


def test_the_replica_is_a_gpt_layer() -> None:
    torch.manual_seed(1)
    layer = bench.MegatronLayer(hidden=32, heads=4, dropout=0.0).double()
    for p in layer.parameters():  # biases and norms away from their zero / one start
        torch.nn.init.normal_(p, std=0.3)
    h = torch.randn(6, 2, 32, dtype=torch.float64)
    # the bias-GeLU's constant is Megatron's 0.79788456 for sqrt(2/pi): ~1e-9 relative
    torch.testing.assert_close(layer(h), _reference(layer, h), rtol=1e-7, atol=1e-8)


def test_full_recomputation_gives_the_gradients_of_none() -> None:
    torch.manual_seed(2)
    layers = torch.nn.ModuleList(bench.MegatronLayer(16, 2, dropout=0.0).double() for _ in range(3))
    grads = []
    for recompute in (False, True):
        x = torch.randn(8, 1, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
        layers.zero_grad(set_to_none=True)
        bench.stack_step(layers, x, recompute)
        grads.append([x.grad, *(p.grad for p in layers.parameters())])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_measurement_runs_and_writes_its_figures(tmp_path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "host.json"
    assert bench.main(["--layers", "1", "--repeats", "2", "--calls", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert len(doc["layer_recompute_s_by_repeat"]) == 2
    assert doc["layer_recompute_s"] == pytest.approx(statistics.median(doc["layer_recompute_s_by_repeat"]))
    assert doc["tiny_layer"] == {"hidden": 16, "heads": 2, "seq": 8, "microbatch": 1}
    assert "host time per layer and micro-batch" in capsys.readouterr().out


def test_bad_arguments_exit_2(tmp_path, capsys) -> None:  # noqa: ANN001
    assert bench.main(["--repeats", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    # an output path that cannot be written (a directory) is refused before the measuring starts
    assert bench.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err


def test_the_prior_is_the_stored_layer_time_over_the_layers_45_kernels() -> None:
    from paratrain.data import DATA_DIR
    from paratrain.plan.crossval import host_issue_prior

    # forward: 2 norms, 4 GEMMs, 2 attention batched GEMMs, softmax, dropout, GeLU, 2 residuals = 13;
    # backward: a GEMM's input and weight gradients (4 x 2), the batched GEMMs' two operands (2 x 2)
    # and one kernel for each of the 7 others = 19; full recomputation runs the forward twice
    layer = ModelSpec(name="gpt", layers=1, hidden=2048, heads=32, seq=1024, vocab=50304, dtype="fp16")
    kernels = [op_kernels(o) for o in layer_ops(layer, tp=1, microbatch=1, fused=True, dtype="fp16",
                                                attention="math")]
    assert sum(f for f, _, _ in kernels) == 13
    assert sum(bi + bw for _, bi, bw in kernels) == 19
    stored = json.loads((DATA_DIR / "measured" / "megatron_ds_host.json").read_text(encoding="utf-8"))
    assert host_issue_prior() == pytest.approx(stored["layer_recompute_s"] / (2 * 13 + 19), rel=1e-12)
    assert 1e-6 < host_issue_prior() < 1e-3 and math.isfinite(host_issue_prior())
