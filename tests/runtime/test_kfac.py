"""K-FAC (paratrain.runtime.kfac) against dense Fisher computations on a tiny MLP, in float64.

The K-FAC block of a linear layer is ``A ⊗ G``: ``A`` the mean of ``[x, 1][x, 1]ᵀ`` over the
samples, ``G`` the mean of ``g gᵀ`` with ``g`` the per-sample output gradient. Here ``G`` and the
empirical Fisher come from one backward per sample (no hooks), the factors from the hooks of
two micro-batches whose pieces are summed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import ConfigError
from paratrain.runtime.kfac import Kfac, KfacLayer, cost_indices, damped_inverse, inv_group_count, linear_layers
from paratrain.schedule.ir import Schedule

N, D0, D1, D2 = 6, 4, 3, 5


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(D0, D1)
        self.l2 = nn.Linear(D1, D2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


@pytest.fixture(autouse=True)
def float64():
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(torch.float32)


def factors_from_hooks(model: MLP, x: torch.Tensor, y: torch.Tensor, *, refresh: int = 1,
                       damping: float = 1e-3, kl_clip: float = 1e9) -> Kfac:
    """Capture two micro-batches (loss = mean over the batch, as gradient accumulation computes it),
    then run the cycle's pieces: curvature per micro-batch, reduction, inversion."""
    layers = [KfacLayer("l1", model.l1), KfacLayer("l2", model.l2)]
    kfac = Kfac(layers, tokens=len(x), dp=1, damping=damping, kl_clip=kl_clip, refresh=refresh, inv_groups=2)
    kfac.begin_step(0)
    half = len(x) // 2
    for mb, sl in enumerate((slice(0, half), slice(half, None))):
        kfac.key = mb
        loss = F.cross_entropy(model(x[sl]), y[sl]) / 2  # micro-batch mean / accumulation steps
        loss.backward()
    kfac.curvature(1)  # the pieces may run in any order
    kfac.curvature(0)
    kfac.reduce()
    kfac.invert(0)
    kfac.invert(1)
    return kfac


def per_sample(model: MLP, x: torch.Tensor, y: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Input, output gradient and weight gradient of each layer for each sample's own loss."""
    out = []
    for i in range(len(x)):
        h1 = model.l1(x[i:i + 1])
        h1.retain_grad()
        a1 = torch.tanh(h1)
        h2 = model.l2(a1)
        h2.retain_grad()
        model.zero_grad()
        F.cross_entropy(h2, y[i:i + 1]).backward()
        out.append({"a1": torch.cat([x[i], torch.ones(1)]), "g1": h1.grad[0].clone(),
                    "a2": torch.cat([a1[0].detach(), torch.ones(1)]), "g2": h2.grad[0].clone(),
                    "M1": torch.cat([model.l1.weight.grad, model.l1.bias.grad[:, None]], 1).clone()})
    model.zero_grad()
    return out


def test_factors_equal_the_dense_means_over_samples():
    model, x, y = MLP(), torch.randn(N, D0), torch.randint(0, D2, (N,))
    kfac = factors_from_hooks(model, x, y)
    samples = per_sample(model, x, y)
    for lay, k in zip(kfac.layers, ("1", "2"), strict=True):
        a_dense = sum(torch.outer(s["a" + k], s["a" + k]) for s in samples) / N
        g_dense = sum(torch.outer(s["g" + k], s["g" + k]) for s in samples) / N
        torch.testing.assert_close(lay.a, a_dense, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(lay.g, g_dense, rtol=1e-12, atol=1e-14)


def test_kronecker_block_is_the_empirical_fisher_when_inputs_do_not_vary():
    """With the same input for every sample the independence assumption holds exactly: the dense
    empirical Fisher of [W | b], built from per-sample gradients, equals G ⊗ A (row-major vec)."""
    model = MLP()
    x = torch.randn(1, D0).repeat(N, 1)
    y = torch.randint(0, D2, (N,))
    kfac = factors_from_hooks(model, x, y)
    grads = [s["M1"].reshape(-1) for s in per_sample(model, x, y)]
    fisher = sum(torch.outer(g, g) for g in grads) / N
    lay = kfac.layers[0]
    torch.testing.assert_close(torch.kron(lay.g, lay.a), fisher, rtol=1e-10, atol=1e-14)


def test_preconditioned_gradient_is_the_dense_damped_kronecker_solve():
    model, x, y = MLP(), torch.randn(N, D0), torch.randint(0, D2, (N,))
    lam = 0.05
    kfac = factors_from_hooks(model, x, y, damping=lam)
    kfac.begin_step(1)  # the next cycle: the inverses become active
    raw = {lay.name: lay.grad_matrix().clone() for lay in kfac.layers}
    nu = kfac.precondition_(lr=0.1)
    assert nu == 1.0  # kl_clip 1e9: no clipping
    for lay in kfac.layers:
        eye_a, eye_g = torch.eye(lay.a.shape[0]), torch.eye(lay.g.shape[0])
        dense = torch.kron(lay.g + lam * eye_g, lay.a + lam * eye_a)  # (G+λI) ⊗ (A+λI), row-major vec
        want = torch.linalg.solve(dense, raw[lay.name].reshape(-1)).reshape(raw[lay.name].shape)
        torch.testing.assert_close(lay.grad_matrix(), want, rtol=1e-9, atol=1e-12)


def test_kl_clip_scales_by_the_closed_form():
    model, x, y = MLP(), torch.randn(N, D0), torch.randint(0, D2, (N,))
    kfac = factors_from_hooks(model, x, y, kl_clip=1e-6)
    kfac.begin_step(1)
    raw = {lay.name: lay.grad_matrix().clone() for lay in kfac.layers}
    pre = {lay.name: lay.active[1] @ raw[lay.name] @ lay.active[0] for lay in kfac.layers}
    lr = 0.5
    vg = sum(float((pre[n] * raw[n]).sum()) for n in raw) * lr**2
    nu = kfac.precondition_(lr=lr)
    assert nu == pytest.approx(min(1.0, math.sqrt(1e-6 / abs(vg))), rel=1e-12) and nu < 1
    for lay in kfac.layers:
        torch.testing.assert_close(lay.grad_matrix(), nu * pre[lay.name], rtol=1e-12, atol=1e-15)


def test_inverses_of_a_cycle_become_active_at_the_next_cycle():
    model, x, y = MLP(), torch.randn(N, D0), torch.randint(0, D2, (N,))
    kfac = factors_from_hooks(model, x, y, refresh=3)
    assert all(lay.pending is not None and lay.active is None for lay in kfac.layers)
    for step in (1, 2):
        kfac.begin_step(step)
        assert not kfac.capturing and not kfac.preconditioning
        assert kfac.precondition_(lr=0.1) is None  # cycle 0 steps on raw gradients
    kfac.begin_step(3)
    assert kfac.capturing and kfac.preconditioning
    assert all(lay.active is not None and lay.pending is None for lay in kfac.layers)


def test_running_average_of_factors():
    model, x, y = MLP(), torch.randn(N, D0), torch.randint(0, D2, (N,))
    kfac = factors_from_hooks(model, x, y)
    first = kfac.layers[0].a.clone()
    x2 = torch.randn(N, D0)
    kfac.begin_step(1)
    kfac.key = 0
    F.cross_entropy(model(x2), y).backward()
    kfac.curvature(0)
    kfac.reduce()
    x2a = torch.cat([x2, torch.ones(N, 1)], 1)
    torch.testing.assert_close(kfac.layers[0].a, 0.95 * first + 0.05 * x2a.T @ x2a / N)


def test_curvature_before_the_backward_is_refused():
    model = MLP()
    kfac = Kfac([KfacLayer("l1", model.l1)], tokens=2, dp=1)
    kfac.begin_step(0)
    model(torch.randn(2, D0))
    with pytest.raises(RuntimeError, match="before the micro-batch's backward"):
        kfac.curvature(0)


def test_damped_inverse_and_helpers():
    f = torch.randn(4, 4)
    f = f @ f.T
    torch.testing.assert_close(damped_inverse(f, 0.1) @ (f + 0.1 * torch.eye(4)), torch.eye(4))
    # rounding can leave a factor slightly indefinite: its negative eigenvalues count as zero
    torch.testing.assert_close(damped_inverse(torch.diag(torch.tensor([1.0, -0.5])), 0.1),
                               torch.diag(torch.tensor([1 / 1.1, 1 / 0.1])))
    row = "F0@c0 B0@c0 X:kfac.curv.0 X:kfac.reduce X:kfac.inv.1 X:kfac.inv.0 X:other R@c0 U"
    sched = Schedule.from_dict({"name": "one", "stages": 1, "microbatches": 1, "actions": [row.split()]})
    assert inv_group_count([sched], 0) == 2
    bad = Schedule.from_dict({"name": "one", "stages": 1, "microbatches": 1,
                              "actions": [row.replace("kfac.inv.0", "kfac.prec").split()]})
    with pytest.raises(ConfigError, match="unknown K-FAC filler"):
        inv_group_count([bad], 0)


def test_only_linear_layers_inside_blocks_are_preconditioned():
    from paratrain.runtime.models import build_model
    from paratrain.spec.model import resolve_model

    model = build_model(resolve_model("gpt-tiny"), 0)
    names = [n for n, _ in linear_layers(model)]
    assert names and all(n.startswith("blocks.") for n in names)
    assert not any("head" in n or "embed" in n for n in names)
    # onto the fill pass's four K-FAC layers per block: QKV, attention output, FFN up, FFN down
    assert cost_indices(names) == [0, 0, 0, 1, 2, 3, 4, 4, 4, 5, 6, 7]


def test_filler_tags_call_the_pieces_and_split_curvature_sums_to_the_whole():
    model, x, y = MLP(), torch.randn(N, D0), torch.randint(0, D2, (N,))
    whole = factors_from_hooks(model, x, y)
    model.zero_grad()
    layers = [KfacLayer("l1", model.l1), KfacLayer("l2", model.l2)]
    kfac = Kfac(layers, tokens=N, dp=1, inv_groups=2)
    fillers = kfac.fillers()
    assert "kfac.curv.7" in fillers and "kfac.curv.7.1" in fillers and "kfac.reduce" in fillers
    assert "kfac.curv.7.2" not in fillers and "kfac.inv.2" not in fillers  # two groups: 0 and 1
    kfac.begin_step(0)
    half = N // 2
    for mb, sl in enumerate((slice(0, half), slice(half, None))):
        kfac.key = mb
        (F.cross_entropy(model(x[sl]), y[sl]) / 2).backward()
    for tag in ("kfac.curv.0.1", "kfac.curv.1", "kfac.curv.0.0", "kfac.reduce", "kfac.inv.1", "kfac.inv.0"):
        fillers[tag]()
    assert kfac.pending_curvature() == []
    for got, want in zip(kfac.layers, whole.layers, strict=True):
        torch.testing.assert_close(got.a, want.a)
        torch.testing.assert_close(got.g, want.g)
        torch.testing.assert_close(got.pending[0], want.pending[0])
