"""Host time of a Megatron-DeepSpeed transformer layer, measured on this machine's CPU.

vTrain's single-node runs (Megatron-DeepSpeed on 2-8 A100, small GPTs) are host-bound: the GPU
waits for the Python, autograd and dispatch work that issues each kernel. The cost model prices
that as ``host_issue_s`` per modelled kernel (:func:`paratrain.cost.compute.host_bound_time`), and
only those runs determine it in a fit. This script measures it apart from them: it builds a layer
with the operator sequence of Megatron-DeepSpeed's GPT layer (pre-norm, QKV linear with its bias,
the scores as ``baddbmm`` into a preallocated buffer, the fused scale-mask-softmax as one operator,
attention dropout, ``bmm``, the context's ``permute().contiguous()``, the projections with their
bias kept apart, TorchScript bias-dropout-add and bias-GeLU, the tensor-parallel region functions
that are identities on one rank) and runs it at a size where every kernel is tiny, so the time is
the framework's per-operator host work. Each layer is checkpointed as Megatron's full activation
recomputation does (a reentrant checkpoint that saves and restores the RNG state), so one layer
and micro-batch is a forward, a recomputed forward and a backward, as in vTrain's runs.

The per-layer time is the slope between two stack depths (``--layers`` and twice that), which
leaves out the fixed cost of a step (the loss, the backward call). ``--out`` writes the figure
as JSON (``paratrain/data/measured/megatron_ds_host.json`` is this script's output on the
project's machine); :mod:`paratrain.plan.crossval` turns it into the A100's host issue time per
modelled kernel, a prior that weighs as one more source in the fit.

What it leaves out (each would add host time): a CUDA launch behind each kernel (here the CPU
runs the tiny kernel itself), Megatron's CUDA RNG tracker, DeepSpeed's engine hooks, and the
tensor-parallel collectives at tp > 1.

    .venv/bin/python bench/bench_megatron_host.py                 # ~1 min, prints the figure
    .venv/bin/python bench/bench_megatron_host.py --out FILE      # and writes it
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# hidden, heads, sequence, micro-batch: every GEMM well under a microsecond of work
TINY = (16, 2, 8, 1)
DROPOUT = 0.1


class _TensorParallelIdentity(torch.autograd.Function):
    """Megatron's copy-to / reduce-from tensor-parallel region on one rank: an autograd function
    whose forward and backward return their input (the all-reduce is skipped at world size 1)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad


with warnings.catch_warnings():  # Megatron-DeepSpeed scripts these two; torch 2.13 deprecates scripting
    warnings.simplefilter("ignore", DeprecationWarning)

    @torch.jit.script
    def _bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, prob: float) -> torch.Tensor:
        return residual + F.dropout(x + bias, p=prob, training=True)

    @torch.jit.script
    def _bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = bias + y
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class _Linear(nn.Module):
    """Column / row parallel linear on one rank: the region function, then ``F.linear``; with
    ``skip_bias_add`` the bias is returned for the fused bias-add that follows."""

    def __init__(self, n_in: int, n_out: int, skip_bias_add: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))
        self.skip_bias_add = skip_bias_add

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = _TensorParallelIdentity.apply(x)
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias), None


class MegatronLayer(nn.Module):
    """One GPT layer with Megatron-DeepSpeed's operator sequence; activations ``[s, b, h]``."""

    def __init__(self, hidden: int, heads: int, dropout: float = DROPOUT) -> None:
        super().__init__()
        self.heads, self.head_dim, self.dropout = heads, hidden // heads, dropout
        self.input_norm = nn.LayerNorm(hidden)
        self.qkv = _Linear(hidden, 3 * hidden, skip_bias_add=False)
        self.dense = _Linear(hidden, hidden, skip_bias_add=True)
        self.post_norm = nn.LayerNorm(hidden)
        self.fc1 = _Linear(hidden, 4 * hidden, skip_bias_add=True)
        self.fc2 = _Linear(4 * hidden, hidden, skip_bias_add=True)
        self.attention_dropout = nn.Dropout(dropout)

    def _attention(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, b, _ = x.shape
        n, d = self.heads, self.head_dim
        mixed, _ = self.qkv(x)
        q, k, v = torch.split(mixed.view(s, b, n, 3 * d), d, dim=-1)
        q, k, v = q.reshape(s, b * n, d), k.reshape(s, b * n, d), v.reshape(s, b * n, d)
        buf = torch.empty(b * n, s, s, dtype=x.dtype)
        scores = torch.baddbmm(buf, q.transpose(0, 1), k.transpose(0, 1).transpose(1, 2),
                               beta=0.0, alpha=1.0 / math.sqrt(d))
        # Megatron's fused upper-triangular scale-mask-softmax is one kernel each way; the causal
        # mask is inside it, so here the softmax runs unmasked: the host's work is the same operator
        probs = self.attention_dropout(torch.softmax(scores.view(b, n, s, s), dim=-1))
        context = torch.bmm(probs.view(b * n, s, s), v.transpose(0, 1)).view(b, n, s, d)
        context = context.permute(2, 0, 1, 3).contiguous().view(s, b, n * d)
        out, bias = self.dense(context)
        return _TensorParallelIdentity.apply(out), bias

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out, bias = self._attention(self.input_norm(h))
        h = _bias_dropout_add(out, bias.expand_as(h), h, self.dropout)
        y, b1 = self.fc1(self.post_norm(h))
        y, b2 = self.fc2(_bias_gelu(b1, y))
        return _bias_dropout_add(_TensorParallelIdentity.apply(y), b2.expand_as(h), h, self.dropout)


def stack_step(layers: nn.ModuleList, x: torch.Tensor, recompute: bool = True) -> None:
    """Forward through ``layers`` (each checkpointed when ``recompute``) and backward."""
    h = x
    for layer in layers:
        h = checkpoint(layer, h, use_reentrant=True) if recompute else layer(h)
    h.sum().backward()


def time_per_layer(layers: int, recompute: bool, repeats: int, calls: int) -> list[float]:
    """Seconds per layer and micro-batch, one figure per repeat: the mean step time of
    ``2·layers`` layers less that of ``layers``, over ``layers``. The two depths alternate step by
    step, so a change in the host's speed during a repeat reaches both alike."""
    hidden, heads, seq, batch = TINY
    torch.manual_seed(0)
    stacks = [nn.ModuleList(MegatronLayer(hidden, heads) for _ in range(n)) for n in (layers, 2 * layers)]
    x = torch.randn(seq, batch, hidden, requires_grad=True)
    for stack in stacks:  # TorchScript profiles its first calls, then optimises
        for _ in range(10):
            stack_step(stack, x, recompute)
    out = []
    for _ in range(repeats):
        spent = [0.0, 0.0]
        for _ in range(calls):
            for i, stack in enumerate(stacks):
                t0 = time.perf_counter()
                stack_step(stack, x, recompute)
                spent[i] += time.perf_counter() - t0
        out.append((spent[1] - spent[0]) / calls / layers)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8, help="stack depth (and twice it) whose difference is timed")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=40, help="steps per timing")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    a = p.parse_args(argv)
    if a.layers < 1 or a.repeats < 1 or a.calls < 1:
        print("error: --layers, --repeats and --calls must be >= 1", file=sys.stderr)
        return 2
    if a.out:
        from paratrain.errors import ConfigError
        from paratrain.fileio import check_output_path

        try:  # before a minute of measuring
            check_output_path(a.out, "--out")
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    rec = time_per_layer(a.layers, True, a.repeats, a.calls)
    plain = time_per_layer(a.layers, False, a.repeats, a.calls)
    doc = {
        "layer_recompute_s": statistics.median(rec),
        "layer_recompute_s_by_repeat": rec,
        "layer_no_recompute_s": statistics.median(plain),
        "layer_no_recompute_s_by_repeat": plain,
        "tiny_layer": dict(zip(("hidden", "heads", "seq", "microbatch"), TINY, strict=True)),
        "threads": 1,
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python bench/bench_megatron_host.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    print(f"Megatron-DeepSpeed layer, host time per layer and micro-batch on {doc['cpu']} (1 thread, torch "
          f"{torch.__version__}):")
    print(f"  with full recomputation (forward, recomputed forward, backward): "
          f"{doc['layer_recompute_s'] * 1e3:.3f} ms (repeats {min(rec) * 1e3:.3f}-{max(rec) * 1e3:.3f})")
    print(f"  without recomputation (forward, backward):                       "
          f"{doc['layer_no_recompute_s'] * 1e3:.3f} ms (repeats {min(plain) * 1e3:.3f}-{max(plain) * 1e3:.3f})")
    if a.out:
        from paratrain.fileio import atomic_write_text

        atomic_write_text(a.out, json.dumps(doc, indent=1) + "\n", "--out")
        print(f"wrote {a.out}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    raise SystemExit(main())
