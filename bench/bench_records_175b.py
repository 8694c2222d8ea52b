"""The published GPT-3 175B records on A100, predicted on their own layouts, beside the planner's
winners for ``paratrain plan --model gpt3-175b --cluster dgx-a100 --gpus 1024 --global-batch 1536``
(issue 12: is the winner faster than the records for a real reason?).

    .venv/bin/python bench/bench_records_175b.py

Records (none used to fit anything; the A100's fitted calibration, ``dgx-a100``):

- Korthikanti et al. 2022 (table 3 / the Megatron-LM README's MFU table): 175B on 64 GPUs, tp 8,
  pp 8, micro-batch 1, batch 64, selective recomputation, sequence parallelism, explicit attention:
  51.4 % MFU. The schedule is not restated there: 1F1B and interleaved (6 chunks) are both shown;
- Narayanan et al. 2021: 175B on 1,024 GPUs at 138 TFLOP/s per GPU, 44.2 % of peak counting the
  recomputation's FLOPs (compare the HFU column); layout assumed: tp 8, pp 16, interleaved with 2
  chunks, micro-batch 1, batch 1,536, full recomputation;
- MegaScale's Megatron-LM rows: ``bench/bench_megascale.py``.

Then, on the plan's problem: the records' layout (dp 16 × tp 8 × pp 8, 6 chunks, micro-batch 1),
the winner before the fp32 gradient buffer and the shared NIC (dp 32 × tp 4 × pp 8, micro-batch 2,
12 chunks) and the winner after them (dp 32 × tp 8 × pp 4, micro-batch 3, 12 chunks). Prints
iteration time, MFU, HFU and peak memory per GPU. Deterministic (no timing of this machine).
"""

from __future__ import annotations

from paratrain.parallel.config import ParallelConfig, Recompute
from paratrain.plan.calibrated import FITTED_BY_DEVICE
from paratrain.plan.validate import with_calibration
from paratrain.sim.report import simulate_config
from paratrain.spec.cluster import ClusterSpec, resolve_cluster
from paratrain.spec.model import resolve_model

SP = dict(sequence_parallel=True, microbatch=1)
ROWS = (
    ("Korthikanti 2022, 64 GPUs, 1F1B (51.4 % MFU)", 64,
     dict(dp=1, tp=8, pp=8, global_batch=64, schedule="1f1b", recompute=Recompute.SELECTIVE, attention="math", **SP)),
    ("Korthikanti 2022, 64 GPUs, interleaved v=6 (51.4 % MFU)", 64,
     dict(dp=1, tp=8, pp=8, global_batch=64, schedule="interleaved", virtual_stages=6,
          recompute=Recompute.SELECTIVE, attention="math", **SP)),
    ("Narayanan 2021, 1,024 GPUs (44.2 % HFU)", 1024,
     dict(dp=8, tp=8, pp=16, microbatch=1, global_batch=1536, schedule="interleaved", virtual_stages=2,
          recompute=Recompute.FULL, sequence_parallel=False, attention="math")),
    ("plan problem: the records' layout", 1024,
     dict(dp=16, tp=8, pp=8, global_batch=1536, schedule="interleaved", virtual_stages=6,
          recompute=Recompute.SELECTIVE, sharding="zero1", **SP)),
    ("plan problem: former winner (tp 4, mb 2)", 1024,
     dict(dp=32, tp=4, pp=8, microbatch=2, global_batch=1536, schedule="interleaved", virtual_stages=12,
          recompute=Recompute.NONE, sequence_parallel=True, sharding="zero1", mesh_order=("pp", "dp", "cp", "tp"))),
    ("plan problem: winner (tp 8, pp 4, mb 3)", 1024,
     dict(dp=32, tp=8, pp=4, microbatch=3, global_batch=1536, schedule="interleaved", virtual_stages=12,
          recompute=Recompute.NONE, sequence_parallel=True, sharding="zero1", mesh_order=("dp", "pp", "cp", "tp"))),
)


def _cluster(gpus: int) -> ClusterSpec:
    base = resolve_cluster("dgx-a100", gpus=gpus)
    return with_calibration(base, FITTED_BY_DEVICE[base.device.name])


def main() -> None:
    model = resolve_model("gpt3-175b")
    print(f"{'layout':58s} {'iter s':>7s} {'MFU':>6s} {'HFU':>6s} {'peak GiB':>9s}")
    for name, gpus, kw in ROWS:
        r = simulate_config(model, _cluster(gpus), ParallelConfig(**kw))
        peak = (r.peak_memory_bytes or 0) / 2**30
        print(f"{name:58s} {r.iteration_time_s:7.2f} {100 * r.mfu:5.1f}% {100 * r.hfu:5.1f}% {peak:9.1f}")


if __name__ == "__main__":
    main()
