"""How many full-model cost evaluations per second the analytical cost model sustains.

One evaluation = ``chunk_costs(model, cluster, config)`` for a whole pipeline: every chunk's
forward/backward/recompute time, TP communication, memory and FLOPs. The configurations cycle
through a planner-like sweep (tp × pp × dp × micro-batch × recomputation × sequence parallelism ×
optimizer sharding), all distinct. "Warm" is the planner's steady state: per-layer costs are
cached after the first configuration with the same per-layer placement. "Cold" clears every
cache before each evaluation (the cost of a never-seen placement).

Run: ``.venv/bin/python bench/bench_cost.py [--model gpt3-175b] [--seconds 3]`` (one process,
one core).
"""

from __future__ import annotations

import argparse
import itertools
import time

from paratrain.cost import collectives, compute, gemm, memory, stage
from paratrain.cost.stage import chunk_costs
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.cluster import resolve_cluster
from paratrain.spec.model import resolve_model


def _configs(model, gpus: int) -> list[ParallelConfig]:
    out = []
    for tp, pp, mb, rc, sp, zero in itertools.product(
        (1, 2, 4, 8), (1, 2, 4, 8, 16, 32), (1, 2, 4), ("none", "selective", "full"), (False, True), (False, True)
    ):
        if sp and tp == 1:
            continue
        dp = gpus // (tp * pp)
        cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, microbatch=mb, recompute=rc, sequence_parallel=sp,
                             optimizer_sharding=zero, global_batch=dp * mb * 64)
        if pp <= model.layers:
            out.append(cfg)
    return out


def _clear() -> None:
    for fn in (stage.layer_cost, stage._end_cost, stage._tp_comm, stage._bundle, stage.layer_params_per_rank,
               compute._layer_ops, compute._embedding_ops, compute._head_ops, memory.activation_terms,
               collectives._collective, collectives.group_layout, gemm.gemm_tile_choice):
        fn.cache_clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--cluster", default="dgx-a100")
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    model = resolve_model(args.model)
    cluster = resolve_cluster(args.cluster, gpus=args.gpus)
    configs = _configs(model, args.gpus)

    _clear()
    t0 = time.perf_counter()
    for cfg in configs:
        chunk_costs(model, cluster, cfg)
    first_pass = time.perf_counter() - t0

    # Rates are per CPU second of this process (what "one core" sustains; the wall clock of a
    # shared machine also counts other processes' time slices) and per wall-clock second.
    n = 0
    w0, c0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - w0 < args.seconds:
        for cfg in configs:
            chunk_costs(model, cluster, cfg)
        n += len(configs)
    warm = n / (time.process_time() - c0)
    warm_wall = n / (time.perf_counter() - w0)

    cold_n = 0
    w0, c0 = time.perf_counter(), time.process_time()
    for cfg in itertools.islice(itertools.cycle(configs), 200):
        _clear()
        chunk_costs(model, cluster, cfg)
        cold_n += 1
    cold = cold_n / (time.process_time() - c0)
    cold_wall = cold_n / (time.perf_counter() - w0)

    print(f"model {model.name}: {model.layers} layers; cluster {cluster.name} with {cluster.num_devices} devices")
    print(f"distinct configurations: {len(configs)} (first pass, caches filling: {first_pass * 1e3:.1f} ms)")
    print(f"warm: {warm:,.0f} full-model evaluations per CPU second ({1e6 / warm:.1f} us each); "
          f"{warm_wall:,.0f} per wall second")
    print(f"cold (all caches cleared each time): {cold:,.0f} per CPU second ({1e3 / cold:.2f} ms each); "
          f"{cold_wall:,.0f} per wall second")
    print(f"target >= 20,000/s warm on one core: {'met' if warm >= 20000 else 'NOT met'}")


if __name__ == "__main__":
    main()
