"""``--optimizer sgd`` (the optimizer the Ok-Topk paper trains and analyses sparse all-reduce
with): SGD with momentum 0.9 and decoupled weight decay on matrices, against the update written
out by hand."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.runtime.config import TrainConfig
from paratrain.runtime.optim import SGD_MOMENTUM, Optimizer


def test_sgd_is_momentum_with_decoupled_decay_on_matrices() -> None:
    w = nn.Parameter(torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64))
    b = nn.Parameter(torch.tensor([0.25, -1.0], dtype=torch.float64))
    train = TrainConfig(steps=1000, lr=0.1, warmup_steps=0, weight_decay=0.5, optimizer="sgd")
    opt = Optimizer([w, b], train)
    gw, gb = torch.full((2, 2), 0.3, dtype=torch.float64), torch.tensor([1.0, -2.0], dtype=torch.float64)
    ew, eb = w.detach().clone(), b.detach().clone()
    vw, vb = torch.zeros_like(ew), torch.zeros_like(eb)
    for step in range(3):
        lr = opt.set_step(step)
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
        vw, vb = SGD_MOMENTUM * vw + gw, SGD_MOMENTUM * vb + gb
        ew = ew * (1 - lr * 0.5) - lr * vw  # decay on matrices only, as AdamW's groups
        eb = eb - lr * vb
        assert torch.allclose(w.detach(), ew, rtol=0, atol=1e-12)
        assert torch.allclose(b.detach(), eb, rtol=0, atol=1e-12)
        assert w.grad is None  # dropped after the step
    assert not hasattr(opt, "adamw")  # nothing that reads AdamW's moments can mistake it for AdamW
