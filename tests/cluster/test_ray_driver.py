"""The driver that runs real jobs: its round loop with a stand-in executor (each slice advances a
job by a fixed number of steps per type, like checkpoints would report), and the checkpoint
reading it relies on. The Ray run itself is ``bench/bench_cluster_ray.py`` (README figures)."""

from __future__ import annotations

import json
from pathlib import Path

from paratrain.cluster.policies import get_policy
from paratrain.cluster.ray_driver import SliceResult, TrainJobSpec, drive, final_loss, newest_checkpoint_step
from paratrain.spec.hetero import parse_accelerators


def test_round_loop_preempts_resumes_and_finishes(tmp_path):
    # Six jobs, three slots (fast: 2, slow: 1). A slice makes 3 steps on fast, 1 on slow; the job
    # is "preempted" unless it reaches its last step within the slice.
    per_slice = {"fast": 3, "slow": 1}
    done: dict[str, int] = {}

    def execute(_, __, work, types):
        out = []
        for (job_dir, _args, steps, _budget, _i), (t, _n) in zip(work, types, strict=True):
            done[job_dir] = min(steps, done.get(job_dir, 0) + per_slice[t])
            finished = done[job_dir] >= steps
            out.append(SliceResult(done[job_dir], finished, 10.0, not finished, 0 if finished else 143))
        return out

    jobs = [TrainJobSpec(f"j{i}", steps=4 + i, train_args=(), throughputs={"fast": 0.3, "slow": 0.1})
            for i in range(6)]
    outcomes = drive(jobs, parse_accelerators("fast=2,slow=1"), get_policy("max_min_fairness_perf"),
                     round_s=10.0, workdir=tmp_path, execute=execute)
    assert all(done[str(tmp_path / f"job{i}")] == jobs[i].steps for i in range(6))
    assert sum(o.preemptions for o in outcomes) > 0
    for o in outcomes:
        assert o.slices == o.preemptions + 1  # every slice but the last was cut short
        assert o.completion_s > 0


def test_newest_complete_checkpoint_and_final_loss(tmp_path: Path):
    ck = tmp_path / "ck"
    for step, complete in ((3, True), (4, True), (5, False)):  # step 5: manifest not written yet
        d = ck / f"step_{step:08d}"
        d.mkdir(parents=True)
        if complete:
            (d / "paratrain-checkpoint.json").write_text("{}")
    assert newest_checkpoint_step(ck) == 4
    assert newest_checkpoint_step(tmp_path / "none") == 0
    m = tmp_path / "m.jsonl"
    m.write_text(json.dumps({"step": 0, "loss": 2.5}) + "\n" + json.dumps({"step": 1, "loss": 2.25}) + "\n")
    assert final_loss(m) == 2.25
