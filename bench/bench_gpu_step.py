"""Where a one-GPU training step of ``paratrain train`` goes: wall time vs GPU kernel time.

Builds the runtime's ``Trainer`` in one process on the visible device (as ``paratrain train
--nproc 1`` does), runs ``--warmup`` steps, then ``--steps`` steps under the torch profiler.
Prints the step's wall time, the GPU's busy time (the sum of kernel times per step: below the
wall when the host, a synchronisation or the launch of small kernels holds the GPU idle) and the
ATen operators with the most device time per step. Compare with ``paratrain simulate`` of the
same model and batch (``bench/gpu_checks.sh`` runs both).

    python bench/bench_gpu_step.py --model gpt2 --microbatch 8 --bf16
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--microbatch", type=int, default=8)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from paratrain.parallel.config import ParallelConfig
    from paratrain.runtime.mesh import init_runtime
    from paratrain.runtime.train import TrainConfig, Trainer
    from paratrain.spec.model import resolve_model

    spec = resolve_model(a.model, "--model")
    config = ParallelConfig(global_batch=a.microbatch, microbatch=a.microbatch)
    ctx = init_runtime(config)
    cuda = ctx.device.type == "cuda"
    trainer = Trainer(ctx, spec, TrainConfig(steps=a.warmup + a.steps, bf16=a.bf16, progress=False))

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(ctx.device)

    for step in range(a.warmup):
        trainer.train_step(step)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for step in range(a.warmup, a.warmup + a.steps):
            trainer.train_step(step)
        sync()
    wall = (time.perf_counter() - t0) / a.steps
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    busy = sum(e.self_device_time_total for e in ops) / 1e6 / a.steps if cuda else 0.0
    tokens = a.microbatch * spec.seq
    print(f"{spec.name} microbatch {a.microbatch} {'bf16 autocast' if a.bf16 else 'fp32'} on {ctx.device}: "
          f"step {wall * 1e3:.2f} ms (profiled), {tokens / wall:,.0f} tokens/s; "
          f"GPU kernels {busy * 1e3:.2f} ms per step "
          f"({100 * busy / wall:.0f} % of the wall)")
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    print(f"{'operator':<48} {'ms/step':>8} {'calls/step':>10}")
    for e in sorted(ops, key=key, reverse=True)[:a.top]:
        print(f"{e.key:<48} {key(e) / 1e3 / a.steps:8.3f} {e.count / a.steps:10.1f}")
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
