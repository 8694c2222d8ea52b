"""Eager PyTorch's element-wise composites as torchtitan and Hugging Face write them: the code that
the cost model's eager kernels (tests/cost/test_eager_elementwise.py) and saved activations
(tests/cost/test_memory_eager_saved.py) are checked against."""

from __future__ import annotations

import torch


def rmsnorm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()  # torchtitan's RMSNorm / Hugging Face's LlamaRMSNorm
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * w


def rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # torchtitan's apply_rotary_emb
    return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(gate, approximate="tanh") * up  # Gemma's (HF GemmaMLP) gate
