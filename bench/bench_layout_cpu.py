"""Where one layout's step time goes on this machine: wall, CPU and collectives per rank and step.

For a layout of ``bench_layouts.py`` (same model and batch), one launch of 4 processes
(one thread each) runs a warm-up step and ``--steps`` timed steps of paratrain's ``Trainer``, then
one more step under a dispatch mode that records every collective. Per rank and step it prints:

- the step's wall time and the process's CPU time (``os.times``: every thread, gloo's included);
- per span of the step loop (``F`` forwards, ``B`` backwards, ``X:clip``, ``U``): wall, process
  CPU and main-thread CPU (``time.thread_time``), and the wall spent waiting in
  ``wait_tensor`` (DTensor's collectives) inside it;
- the collectives of the recorded step: ``(span, op, bytes per rank): count``.

The process CPU less the main thread's is what the communication threads spend. Compare with
the cost model's work per micro-batch (compute and DTensor dispatch) and waits: when the sum of
every rank's CPU over the cores is close to the measured step, the step is CPU-bound and a
wait of one process is filled by the others' work.

    .venv/bin/python bench/bench_layout_cpu.py dp2-tp2 --steps 3    # about 30 s idle
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_layouts as bl


def _instrument(spans: dict[str, list[float]], current: list[str | None]) -> None:
    """Time the step loop's spans (wall, process CPU, main-thread CPU) and DTensor's waits."""
    import torch.distributed._functional_collectives as funcol

    from paratrain.runtime import metrics

    wait = funcol.wait_tensor

    def timed_wait(t: Any) -> Any:
        w0 = time.perf_counter()
        out = wait(t)
        if current[0] is not None:
            spans[current[0]][3] += time.perf_counter() - w0
            spans[current[0]][4] += 1
        return out

    funcol.wait_tensor = timed_wait  # AsyncCollectiveTensor waits through this module attribute
    enter, leave = metrics._Span.__enter__, metrics._Span.__exit__

    def span_enter(self: Any) -> None:
        self.key = self.name.split("@")[0].rstrip("0123456789") if self.name[0] in "FB" else self.name
        self.clocks = (time.perf_counter(), time.process_time(), time.thread_time())
        current[0] = self.key
        enter(self)

    def span_exit(self: Any, *exc: object) -> None:
        leave(self, *exc)
        w, p, t = self.clocks
        row = spans[self.key]
        row[0] += time.perf_counter() - w
        row[1] += time.process_time() - p
        row[2] += time.thread_time() - t
        current[0] = None

    metrics._Span.__enter__, metrics._Span.__exit__ = span_enter, span_exit


def _record_collectives(run_step: Any, current: list[str | None]) -> dict[str, int]:
    """Every c10d operator one step issues, as ``"span op bytes": count`` (the input of an
    all-reduce or reduce-scatter, the output of an all-gather; bytes of the first tensor)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter[str] = collections.Counter()

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = func._schema.name
            if "c10d" in name and "wait" not in name and "wrap" not in name:
                t = out if "gather" in name else args[0]
                while isinstance(t, (list, tuple)) and t:
                    t = t[0]
                nbytes = t.numel() * t.element_size() if hasattr(t, "numel") else -1
                counts[f"{current[0]} {name.split('::')[1]} {nbytes}"] += 1
            return out

    with Recorder():
        run_step()
    return dict(sorted(counts.items()))


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from paratrain.runtime.mesh import init_runtime
    from paratrain.runtime.train import TrainConfig, Trainer

    torch.set_num_threads(1)
    spans: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0])
    current: list[str | None] = [None]
    _instrument(spans, current)
    out = Path(a.out)
    # the tracer's spans are what is timed: a trace path enables them (the file is not written)
    train = TrainConfig(steps=a.steps + 2, data="synthetic", metrics=str(out / "metrics.jsonl"), progress=False,
                        log_every=a.steps + 2, trace=str(out / "trace.json"))
    ctx = init_runtime(bl._config(a, a.layout))
    torch.manual_seed(train.seed)
    trainer = Trainer(ctx, bl._spec(a), train)
    trainer.train_step(0)  # warm-up
    spans.clear()
    walls, t0, main0 = [], os.times(), time.thread_time()
    for step in range(1, a.steps + 1):
        w0 = time.perf_counter()
        trainer.train_step(step)
        walls.append(time.perf_counter() - w0)
    t1 = os.times()
    main_cpu = (time.thread_time() - main0) / a.steps
    cpu = (t1.user - t0.user + t1.system - t0.system) / a.steps
    system = (t1.system - t0.system) / a.steps
    per_step = {k: [v / a.steps for v in row] for k, row in spans.items()}
    counts = _record_collectives(lambda: trainer.train_step(a.steps + 1), current)
    rows: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(rows, {"rank": ctx.rank, "step_s": walls, "cpu_s": cpu, "system_s": system,
                                  "main_thread_s": main_cpu, "spans": per_step,
                                  "collectives": counts})
    if ctx.rank == 0:
        (out / "result.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _entry(argv: list[str]) -> None:
    """One of the four workers :func:`bench_layouts.launch_workers` forks (as ``paratrain train``'s)."""
    p = argparse.ArgumentParser()
    p.add_argument("layout")
    p.add_argument("--steps", type=int)
    p.add_argument("--out")
    bl.add_model_flags(p)
    worker(p.parse_args(argv))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layout", choices=[*bl.LAYOUTS, *bl.CP_LAYOUTS])
    p.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    bl.add_model_flags(p)
    a = p.parse_args()
    if a.steps < 1:
        p.error("--steps must be at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-layout-cpu-") as tmp:
        args = [a.layout, f"--steps={a.steps}", *bl.model_argv(a)]
        bl.launch_workers([*args, f"--out={tmp}"], {**os.environ, "OMP_NUM_THREADS": "1"}, _entry)
        rows = json.loads((Path(tmp) / "result.json").read_text())
    print(f"{a.layout}: {a.steps} step(s) after a warm-up, per rank and step (seconds)")
    for r in rows:
        steps = " ".join(f"{s:.3f}" for s in r["step_s"])
        print(f"rank {r['rank']}: step {steps}; CPU {r['cpu_s']:.3f} (in the kernel {r['system_s']:.3f}; "
              f"main thread {r['main_thread_s']:.3f}, other threads {r['cpu_s'] - r['main_thread_s']:.3f})")
        for name, (wall, proc, main_cpu, waits_s, waits) in r["spans"].items():
            print(f"  {name:<7} wall {wall:7.3f}  CPU {proc:6.3f}  main thread {main_cpu:6.3f}  "
                  f"other threads {proc - main_cpu:6.3f}  waits {waits:5.0f} taking {waits_s:6.3f}")
    print("collectives of one step (span, op, bytes per rank: count), rank 0:")
    for key, n in rows[0]["collectives"].items():
        print(f"  {key}: {n}")


if __name__ == "__main__":
    main()
