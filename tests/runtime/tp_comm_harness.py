"""Worker for tests/runtime/test_calibrate_tp.py: what DTensor issues, and what calibrate measures.

Run as ``python -m torch.distributed.run --nproc-per-node 2 tests/runtime/tp_comm_harness.py
OUT.json``. For each model of ``MODELS`` (a GPT and a Llama-like model, sequence parallelism off
and on) it applies the runtime's tensor parallelism (``apply_tensor_parallel``) and records every
functional collective of one micro-batch's forward and backward (loss included, as the step loop
runs them) with a dispatch mode: its kind and its bytes per rank (the input of an all-reduce or a
reduce-scatter, the output of an all-gather), and those of the calibration's bare block (without
and with sequence parallelism). Then it runs the calibration's tensor-parallel
measurements (``measure_tp_collectives``, ``measure_tp_dispatch``) once. Rank 0 writes
``{"issued": {case: {"forward": [[kind, bytes], ...], "backward": [...]}}, "measured": [...],
"dispatch": [forward_s, backward_s], "collective_cpu": [...]}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from paratrain.runtime.calibrate_tp import BLOCK_SHAPES, _block_spec, measure_tp_collectives, measure_tp_dispatch
from paratrain.runtime.models import TransformerLM, build_model
from paratrain.runtime.models.layers import Block
from paratrain.runtime.tensor_parallel import (
    accumulating_partial_grads,
    apply_tensor_parallel,
    block_plan,
    loss_context,
)
from paratrain.spec.model import from_document

GPT = {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64, "dtype": "fp32", "name": "gpt"}
LLAMA = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 48, "seq": 16, "vocab": 64,
         "norm": "rmsnorm", "activation": "swiglu", "position": "rotary", "tied_embeddings": False, "bias": False,
         "dtype": "fp32", "name": "llama"}
MODELS = {"gpt": GPT, "llama": LLAMA}
MICROBATCH = 2
ACCUMULATED = 3  # micro-batches of the accumulated step
_KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter"}


class Recorder(CommDebugMode):
    """Records ``[kind, bytes]`` of every functional collective, as ``CommDebugMode`` sees them
    (which includes the ones DTensor's own operator handlers issue, such as ``loss_parallel``'s)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        name = getattr(func, "_schema", None) and func._schema.name
        if name and "c10d_functional::" in name:
            kind = _KINDS.get(name.split("::")[1])
            if kind is not None:
                t = out if kind == "all_gather" else args[0]
                self.calls.append([kind, t.numel() * t.element_size()])
        return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    issued: dict[str, Any] = {}
    for name, doc in MODELS.items():
        spec = from_document(doc)
        for sp in (False, True):
            model = apply_tensor_parallel(build_model(spec, 0), mesh, sequence_parallel=sp)
            gen = torch.Generator().manual_seed(0)
            x = torch.randint(0, spec.vocab, (MICROBATCH, spec.seq), generator=gen)
            y = torch.randint(0, spec.vocab, (MICROBATCH, spec.seq), generator=gen)
            with Recorder() as fwd, loss_context(world):
                loss = TransformerLM.loss(model(x), y)
            with Recorder() as bwd, loss_context(world):
                loss.backward()
            issued[f"{name}{'-sp' if sp else ''}"] = {"forward": fwd.calls, "backward": bwd.calls}
            if sp:
                # a step of ACCUMULATED micro-batches as the step loop runs them: every backward but
                # the last keeps the norms' partial gradients (accumulating_partial_grads)
                model.zero_grad(set_to_none=True)
                calls: list[list[Any]] = []
                for i in range(ACCUMULATED):
                    with accumulating_partial_grads(i < ACCUMULATED - 1), loss_context(world):
                        with Recorder() as fwd:
                            loss = TransformerLM.loss(model(x), y)
                        with Recorder() as bwd:
                            loss.backward()
                    calls += fwd.calls + bwd.calls
                issued[f"{name}-sp-accumulated"] = {"backward": calls}
                grads = {n: _full(p.grad) for n, p in model.named_parameters()}
                ref = apply_tensor_parallel(build_model(spec, 0), mesh, sequence_parallel=sp)
                for _ in range(ACCUMULATED):  # every backward reducing its own: the same sums
                    with loss_context(world):
                        TransformerLM.loss(ref(x), y).backward()
                worst = max(float((grads[n] - _full(p.grad)).abs().max()) for n, p in ref.named_parameters())
                issued[f"{name}-sp-accumulated"]["max_grad_difference"] = worst
    # the calibration's bare block (no runtime gradient hooks), as measure_tp_collectives runs it
    hidden, seq, batch = BLOCK_SHAPES[0]
    spec = _block_spec(world, hidden, seq)
    for sp in (False, True):
        block = parallelize_module(Block(spec, pre_norm=True), mesh, block_plan(swiglu=False, sequence_parallel=sp))
        x = torch.randn(batch, spec.seq // world if sp else spec.seq, spec.hidden, requires_grad=True)
        with Recorder() as fwd:
            out = block(x)
        with Recorder() as bwd:
            out.sum().backward()
        issued[f"block{'-sp' if sp else ''}"] = {"forward": fwd.calls, "backward": bwd.calls}
    dispatch = measure_tp_dispatch()
    measured, collective_cpu = measure_tp_collectives(rank, world, dispatch)
    if rank == 0:
        with open(sys.argv[1], "w", encoding="utf-8") as fh:
            json.dump({"issued": issued, "measured": measured, "dispatch": dispatch,
                       "collective_cpu": collective_cpu}, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
