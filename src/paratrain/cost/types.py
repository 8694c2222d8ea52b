"""Result types of the cost model shared by the simulator and the planner."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChunkCost", "CollectiveCost"]


@dataclass(frozen=True)
class ChunkCost:
    """Cost of one model chunk (a contiguous slice of layers on one pipeline rank, possibly with
    the embedding and/or the head) for one micro-batch, on one rank of its tensor-parallel group.

    Times include the tensor-parallel collectives inside the chunk (``tp_comm_s`` of them).
    """

    forward_s: float
    backward_input_s: float  # dL/dx part of backward (what the previous stage waits for)
    backward_weight_s: float  # dL/dW part (deferrable in zero-bubble schedules)
    recompute_s: float  # forward recomputation before backward (0 without recomputation)
    tp_comm_s: float  # time in tensor-parallel collectives, forward + backward
    activation_bytes: int  # held per in-flight micro-batch between its forward and backward
    weight_bytes: int  # this rank's parameters of the chunk
    grad_bytes: int  # this rank's gradients of the chunk
    optimizer_bytes: int  # this rank's optimizer state (after optimizer-state sharding)
    grad_reduce_bytes: int  # gradient bytes reduced over data-parallel ranks per iteration
    p2p_bytes: int  # activation (and its gradient) sent between stages per micro-batch
    model_flops: float  # matmul FLOPs (forward + backward, no recomputation) per micro-batch, this rank
    # Activations one layer recomputes, live only while that layer runs its backward (0 without
    # recomputation): add once to the peak, not per in-flight micro-batch.
    transient_bytes: int = 0
    # Context-parallel ring transfers not hidden behind the attention blocks (cost.context_parallel),
    # forward + backward (+ the recomputed forward); already inside the compute times, like tp_comm_s.
    cp_comm_s: float = 0.0
    # FSDP's all-gathers and reduce-scatters not hidden behind the neighbouring units' compute
    # (cost.sharding; zero2/zero3 over dp > 1), forward + backward; inside the compute times.
    fsdp_comm_s: float = 0.0
    # Waits in collectives inside forward_s and inside the backward's recompute_s + backward_input_s:
    # the tensor-parallel collectives (tp_comm_s less DTensor's host dispatch, which is work) and
    # the exposed context-parallel ring. A waiting process takes no core, so where processes share
    # a host's cores (paratrain.sim.sharing) these parts are not stretched.
    forward_wait_s: float = 0.0
    backward_wait_s: float = 0.0
    # The all-gather over the tensor-parallel group that re-assembles an activation (or its
    # gradient) received as 1/tp slices (Megatron's scatter/gather, cost.stage._p2p_split): part
    # of each transfer between stages.
    p2p_gather_s: float = 0.0
    # Transformer Engine's cached FP8 weights and their transposes (ParallelConfig.fp8_weight_cache,
    # cost.fp8.cached_weight_bytes), held through the step like the weights.
    fp8_cache_bytes: int = 0

    @property
    def backward_s(self) -> float:
        """Whole backward: recomputation, input gradient and weight gradient."""
        return self.recompute_s + self.backward_input_s + self.backward_weight_s

    @property
    def static_bytes(self) -> int:
        """Memory that does not depend on in-flight micro-batches."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes + self.fp8_cache_bytes


@dataclass(frozen=True)
class CollectiveCost:
    """Time of one collective and the algorithm that achieves it."""

    time_s: float
    algorithm: str
    bytes_per_rank: float  # bytes each rank sends over the slowest link class it uses
