"""Real execution: the round mechanism drives ``paratrain train`` jobs through Ray.

Accelerator types are Ray custom resources (a local cluster on one machine declares, say,
``{"acc_a": 2, "acc_b": 1}``); each round the mechanism places jobs, and every placed job runs as a
Ray task holding ``scale_factor`` units of its type's resource. The task starts ``paratrain train``
with its full ``--steps`` (the learning-rate schedule spans the whole run), checkpointing every step
(``--checkpoint-every 1``) and, once a checkpoint exists, ``--resume``. At the round's end a job that
is still running is preempted (SIGTERM to its process group); it resumes from its newest complete
checkpoint the next time it is placed, on whichever type. Steps done are read from the checkpoints,
the measured steps/s update the mechanism's throughputs by EMA, and a job is done when its process
exits 0 after the last step.

Ray is optional (``pip install -e '.[cluster]'``); :func:`run_slice` is plain Python and the driver
takes any executor with Ray's ``remote``/``get`` shape, so the logic is testable without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.cluster.policies import Policy
from paratrain.cluster.rounds import RoundMechanism
from paratrain.cluster.trace import Job
from paratrain.errors import ConfigError
from paratrain.spec.hetero import HeteroClusterSpec

__all__ = ["TrainJobSpec", "SliceResult", "JobOutcome", "run_slice", "newest_checkpoint_step", "drive",
           "ray_executor", "final_loss", "job_final_loss"]

_TERM_GRACE_S = 30.0


@dataclass(frozen=True)
class TrainJobSpec:
    """One training job: ``train_args`` are ``paratrain train`` flags (model, seed, data…) except
    ``--steps`` and the checkpoint flags, which the driver sets; ``throughputs`` are first guesses
    of steps/s per accelerator type (measurements replace them)."""

    name: str
    steps: int
    train_args: tuple[str, ...]
    throughputs: dict[str, float]
    scale_factor: int = 1


@dataclass
class SliceResult:
    steps_done: int  # after this slice (newest complete checkpoint)
    finished: bool  # the checkpoint of the last step is complete (even if the stop came right after)
    elapsed_s: float
    preempted: bool
    returncode: int


@dataclass
class JobOutcome:
    name: str
    completion_s: float
    slices: int
    preemptions: int
    types_used: list[str] = field(default_factory=list)
    final_loss: float | None = None


def newest_checkpoint_step(ck_dir: Path) -> int:
    """The step of the newest complete checkpoint (its manifest written last), 0 without one."""
    best = 0
    if ck_dir.is_dir():
        for d in ck_dir.iterdir():
            if d.name.startswith("step_") and (d / "paratrain-checkpoint.json").is_file():
                try:
                    best = max(best, int(d.name[len("step_"):]))
                except ValueError:
                    continue
    return best


def final_loss(metrics: Path) -> float | None:
    """The loss on the last line of a ``--metrics`` file."""
    if not metrics.is_file():
        return None
    lines = [ln for ln in metrics.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return float(json.loads(lines[-1])["loss"]) if lines else None


def job_final_loss(job_dir: Path, slices: int) -> float | None:
    """The loss of a job's last step: the last line of its newest slice that logged one."""
    for i in reversed(range(slices)):
        loss = final_loss(job_dir / f"metrics-{i}.jsonl")
        if loss is not None:
            return loss
    return None


def run_slice(job_dir: str, train_args: list[str], steps: int, budget_s: float | None,
              slice_index: int = 0) -> SliceResult:
    """Run (or resume) one job for at most ``budget_s`` seconds of wall time."""
    d = Path(job_dir)
    d.mkdir(parents=True, exist_ok=True)
    ck = d / "checkpoints"
    resume = newest_checkpoint_step(ck) > 0
    cmd = [sys.executable, "-m", "paratrain", "train", *train_args, "--steps", str(steps),
           "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--keep", "2",
           "--metrics", str(d / f"metrics-{slice_index}.jsonl"), "--no-progress"]
    if resume:
        cmd.append("--resume")
    # One intra-op thread in every slice, whoever launches it (Ray sets OMP_NUM_THREADS=1 in its
    # workers): float32 reductions then run in one order, so a resumed run can match an
    # uninterrupted one bit for bit.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t0 = time.monotonic()
    with open(d / f"log-{slice_index}.txt", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        preempted = False
        try:
            rc = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            preempted = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=_TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    done = newest_checkpoint_step(ck)
    return SliceResult(done, done >= steps, time.monotonic() - t0, preempted, rc)


Executor = Callable[[str, int, list[tuple[str, list[str], int, float, int]]], list[SliceResult]]


def ray_executor(address: str | None = None, resources: dict[str, float] | None = None) -> Executor:
    """Run each round's slices as Ray tasks holding their type's custom resource."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, resources=resources, include_dashboard=False, log_to_driver=False,
                 num_cpus=sum((resources or {}).values()) or None)
    task = ray.remote(num_cpus=0)(run_slice)

    def execute(_: str, __: int, work: list[tuple[str, list[str], int, float, int]],
                types: list[tuple[str, int]] | None = None) -> list[SliceResult]:
        refs = [task.options(resources={t: float(n)}).remote(*w) for w, (t, n) in zip(work, types or [], strict=True)]
        return list(ray.get(refs))

    return execute  # type: ignore[return-value]


def drive(jobs: list[TrainJobSpec], cluster: HeteroClusterSpec, policy: Policy, *, round_s: float,
          workdir: Path, execute: Callable[..., list[SliceResult]]) -> list[JobOutcome]:
    """Schedule ``jobs`` round by round until all finish; returns per-job outcomes."""
    if policy.is_packed:
        raise ConfigError("--policy", f"{policy.name} co-locates jobs, which the Ray driver does not do",
                          "use a policy without _packed")
    mech = RoundMechanism(cluster, policy, round_s=round_s)
    for i, spec in enumerate(jobs):
        mech.add_job(i, Job(spec.name, spec.steps, spec.scale_factor), spec.throughputs)
    outcomes = {i: JobOutcome(spec.name, 0.0, 0, 0) for i, spec in enumerate(jobs)}
    # A slice that ended before the job's first step (process start-up longer than the round) gets
    # twice the time next, so a job always progresses.
    stretch = {i: 1.0 for i in range(len(jobs))}
    now = 0.0
    rounds = 0
    while mech.jobs:
        rounds += 1
        placed = mech.schedule(now)
        if not placed:
            raise RuntimeError("no job could be placed: check the accelerator resources")
        work, types, ids = [], [], []
        for j, ws in placed.items():
            t = mech.worker_type[ws[0]]
            spec = jobs[j]
            work.append((str(workdir / f"job{j}"), list(spec.train_args), spec.steps, round_s * stretch[j],
                         outcomes[j].slices))
            types.append((t, len(ws)))
            ids.append(j)
        results = execute("round", rounds, work, types)
        for j, (t, _), res in zip(ids, types, results, strict=True):
            o = outcomes[j]
            o.slices += 1
            o.preemptions += int(res.preempted and not res.finished)  # stopped before its last step
            o.types_used.append(t)
            active = mech.jobs[j]
            new_steps = res.steps_done - active.steps_done
            if new_steps > 0:
                mech.observe(j, t, new_steps, res.elapsed_s)
                stretch[j] = 1.0
            elif not res.finished:
                stretch[j] *= 2
            mech.record(j, t, max(new_steps, 0), res.elapsed_s)
            if res.finished:
                o.completion_s = now + res.elapsed_s
                o.final_loss = job_final_loss(workdir / f"job{j}", o.slices)
                mech.remove_job(j)
        now += max(r.elapsed_s for r in results)
    return [outcomes[i] for i in range(len(jobs))]
