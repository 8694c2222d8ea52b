"""Time of the optimizer step (AdamW) on one rank.

The step is memory-bound: its time is the bytes it moves over the device's memory bandwidth. The
planner's closed forms and the simulator both time it here.
"""

from __future__ import annotations

from paratrain.cost.compute import dtype_bytes
from paratrain.errors import ConfigError
from paratrain.spec.device import DeviceSpec

__all__ = ["OPTIMIZERS", "optimizer_step_bytes", "optimizer_step_s"]

# How the step is implemented: ``fused`` (one pass over the state, Megatron/Apex's fused Adam) or
# ``torch`` (PyTorch's AdamW with ``foreach=False`` and global-norm clipping, as ``paratrain train``
# runs them).
OPTIMIZERS = ("fused", "torch")

# Element accesses (reads + writes) per parameter of PyTorch's single-tensor AdamW (torch.optim
# ``_single_tensor_adam``, ``foreach=False``) in fp32, kernel by kernel: decoupled weight decay
# ``param.mul_`` 2, ``exp_avg.lerp_(grad)`` 3, ``exp_avg_sq.mul_`` 2 and ``.addcmul_(grad, grad)`` 3,
# ``denom = (exp_avg_sq.sqrt() / c).add_(eps)`` 6, ``param.addcdiv_(exp_avg, denom)`` 4 = 20; and
# global-norm clipping as paratrain's runtime does it: ``grad.pow(2).sum()`` 3, ``grad.mul_(coef)`` 2.
_TORCH_ADAMW_ACCESSES = 25


def optimizer_step_bytes(
    weight_bytes: float,
    grad_bytes: float,
    optimizer_bytes: float,
    *,
    optimizer: str = "fused",
    dtype: str = "bf16",
) -> float:
    """Bytes one optimizer step moves on a rank holding these weights, gradients and optimizer
    state. ``fused``: mixed-precision Adam reads the gradients, reads and writes the optimizer
    state (fp32 master weights and both moments) and writes the weights once. ``torch``: every
    element-wise kernel of torch's AdamW and of the clipping is its own pass over fp32 elements
    (``weight_bytes / dtype_bytes(dtype)`` parameters)."""
    if optimizer == "fused":
        return weight_bytes + grad_bytes + 2 * optimizer_bytes
    if optimizer == "torch":
        return _TORCH_ADAMW_ACCESSES * 4 * weight_bytes / dtype_bytes(dtype)
    raise ConfigError("optimizer", f"unknown optimizer implementation {optimizer!r}",
                      f"use one of: {', '.join(OPTIMIZERS)}")


def optimizer_step_s(
    weight_bytes: float,
    grad_bytes: float,
    optimizer_bytes: float,
    device: DeviceSpec,
    *,
    optimizer: str = "fused",
    dtype: str = "bf16",
) -> float:
    """Seconds of one optimizer step: :func:`optimizer_step_bytes` over the memory bandwidth."""
    nbytes = optimizer_step_bytes(weight_bytes, grad_bytes, optimizer_bytes, optimizer=optimizer, dtype=dtype)
    return nbytes / device.memory_bandwidth_Bps
