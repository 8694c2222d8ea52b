"""The two phases of a checkpoint, when to take one, and resuming: :class:`Checkpointer`.

At a step boundary the step loop calls :meth:`Checkpointer.after_step`. When a checkpoint is due
it takes references to the state (:func:`.state.capture`, cheap) and starts one background thread:

1. *snapshot*: host copies of every tensor (:func:`.state.snapshot_into`), into shared-memory
   tensors allocated once per run, on that thread alone (:func:`.state.one_thread_here`). It
   overlaps the next step's forward and backward; a pre-hook on
   AdamW's ``step`` waits for it, so the optimizer never changes a weight the snapshot has not
   copied yet (CheckFreq's ``weight_update`` spin; torchtitan's ``maybe_wait_for_staging`` before
   ``optimizer.step()``);
2. *persist*, in this rank's writer process (:mod:`.writer`, nice +10, started with the
   checkpointer): ``torch.distributed.checkpoint.save`` of the shared-memory snapshot, read in
   place (every rank's writer writes its pieces, fsynced, on the writers' own gloo group), then
   rank 0's writer writes the completion marker with every file's checksum and prunes to
   ``--keep``. The thread waits for the writer's answer; a writer that dies fails the run at the
   next join with one line.

A new checkpoint first joins the previous thread: at most one checkpoint is in flight (the
shared-memory snapshot is rewritten only after the writer finished reading it). How often
(:mod:`.frequency`): every N steps; every N seconds (converted with the measured step time); or
``auto``, CheckFreq's tuner: after :data:`~.frequency.PROFILE_STEPS` timed steps a first
checkpoint, overlapped like the others, measures what one costs (the training thread's time on it
and the slowdown of every step of its interval against a reference taken far from any write,
:class:`.frequency.CostLedger`); ``k`` is chosen when it is complete on every rank and re-tuned at
each checkpoint from the costs measured so far (:func:`.frequency.budget_interval`).
Every rank decides the same ``k`` from the maximum of the ranks' measurements (small all-reduces
on a gloo group of their own, at a checkpoint and while the first one is written).
Asynchronous pipelines (PipeDream, 2BW) drain at each checkpoint step
(:attr:`~paratrain.runtime.pipeline.PipelineExecutor.drain_at`); their first checkpoint is waited for.
The end of the run always writes a checkpoint of the last step (synchronously).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from paratrain.errors import ConfigError
from paratrain.runtime import faults
from paratrain.runtime.comm import layer as comm
from paratrain.runtime.optim import lr_at

from . import frequency, state, store
from .reshard import load_into
from .writer import WriterProcess

if TYPE_CHECKING:
    from collections.abc import Callable

    from paratrain.runtime.train import Trainer

__all__ = ["Checkpointer"]

class Checkpointer:
    """Checkpoints of one rank's trainer into ``train.checkpoint_dir`` (module docstring).

    Construct on every rank after the trainer (it creates a process group: a collective).
    ``say``: the step console's rank-0 line printer.
    """

    def __init__(self, trainer: Trainer, say: Callable[[str], None]) -> None:
        t = trainer.train
        assert t.checkpoint_dir is not None
        self.trainer, self.say = trainer, say
        self.root = Path(t.checkpoint_dir)
        self.every = frequency.parse_every(t.checkpoint_every)
        self.keep, self.bound = t.keep, t.checkpoint_overhead
        self.rank, self.world = trainer.ctx.rank, trainer.ctx.world_size
        # the training thread's decisions (and the writers' rendezvous), apart from training's collectives
        self.control = dist.new_group(backend="gloo")
        self.writer = WriterProcess(self.rank, self.world, self.control, trainer.ctx.timeout_s)
        self._hook = trainer.optimizer.adamw.register_step_pre_hook(self._before_update)
        self._snapshotted = threading.Event()
        self._snapshotted.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._inflight: dict[str, Any] | None = None  # the checkpoint being written
        self._last: dict[str, Any] | None = None  # measurements of the last finished one
        self._stall_s = 0.0  # waited inside the current step (snapshot not done at the update)
        self._start = 0
        self._k = 0  # current interval (auto, seconds)
        self._next_at: int | None = None
        self._decide_at: int | None = None
        self._ledger = frequency.CostLedger()  # what checkpoints have cost the loop, every step counted
        self._profiling: int | None = None  # auto: step of the first checkpoint while it is written
        self.saved: list[int] = []
        self.last_overhead: float | None = None  # measured over the last interval (auto)
        if getattr(trainer.executor, "is_async", False):
            # PipeDream / 2BW run segments of steps as one action list: drain where a checkpoint
            # (or auto's first decision) is due, so that the step boundary exists and the state is one
            other = trainer.executor.drain_at  # an evaluation's drains, if any

            def drain_at(step: int) -> int | None:
                found = [b for b in (self.next_boundary(step), other(step) if other else None) if b is not None]
                return min(found) if found else None
            trainer.executor.drain_at = drain_at

    # ----- resume ---------------------------------------------------------------------------------
    def restore(self) -> int:
        """Load the newest complete checkpoint (``--resume``); returns the step to run next."""
        info, skipped = store.resume_checkpoint(self.root)
        manifest = info.manifest or {}
        tr = self.trainer
        store.check_compatible(manifest, tr.spec.to_dict(), tr.train.seed)
        step = int(manifest["step"])
        if step >= tr.train.steps:
            raise ConfigError("--resume", f"the newest checkpoint is at step {step}, and --steps is {tr.train.steps}",
                              f"use --steps above {step} to train further")
        for c in skipped:
            self.say(f"checkpoint {c.path.name} skipped: {c.status} ({c.problem})")
        start = time.perf_counter()
        try:
            load_into(tr, info)
        except ValueError as e:
            raise ConfigError("--resume", f"{info.path} does not fit this model: {e}",
                              "resume with the model flags of the run that wrote it") from None
        was = manifest.get("parallel", {})
        if was.get("global_batch") != tr.config.global_batch:
            self.say(f"note: global batch {tr.config.global_batch} differs from the checkpoint's "
                     f"{was.get('global_batch')}: the batches from step {step} on differ from the first run's")
        cp = f" cp={was['cp']}" if was.get("cp", 1) > 1 else ""
        self.say(f"resumed from {info.path} (step {step}, saved under dp={was.get('dp')} tp={was.get('tp')} "
                 f"pp={was.get('pp')}{cp}) in {time.perf_counter() - start:.3f} s")
        self.saved.append(step)
        return self._begin(step)

    def begin(self) -> int:
        """Start without resuming; returns 0, the step to run first."""
        return self._begin(0)

    @property
    def interval(self) -> int | None:
        """Steps between checkpoints as last decided (``None`` before the first decision)."""
        if self.every.kind == "steps":
            return int(self.every.value)
        return self._k or None

    def next_boundary(self, step: int) -> int | None:
        """The first step boundary after ``step`` where this checkpointer acts (a checkpoint, or the
        measured step time turned into an interval); ``None`` when none is planned yet."""
        due = [s for s in (self._next_at, self._decide_at) if s is not None and s > step]
        return min(due) if due else None

    def _begin(self, step: int) -> int:
        self._start = step
        if self.every.kind == "auto":  # the steps that measure a clean step must not share the cores with its start
            self.writer.wait_ready()
        if self.every.kind == "steps":
            n = int(self.every.value)
            self._next_at = (step // n + 1) * n
        else:
            self._decide_at = step + 1 + frequency.PROFILE_STEPS
        return step

    # ----- the step boundary ------------------------------------------------------------------------
    def after_step(self, step: int, row: dict[str, Any]) -> dict[str, Any]:
        """Called with each step's metrics row, after the step; returns the row's checkpoint keys."""
        done = step + 1  # optimizer steps completed: the checkpoint's step
        start = time.perf_counter()
        waited, self._stall_s = self._stall_s, 0.0  # inside the step (its time includes it)
        if step > self._start:  # the first step after start-up allocates and warms up
            self._ledger.observe(row["step_time_s"], writing=self._inflight is not None, waited_s=waited)
        self._poll()
        extra: dict[str, Any] = {}
        if done < self.trainer.train.steps:
            if self._profiling is not None:
                self._profiled(done)
            if self._decide_at == done and self.every.kind == "seconds":
                self._k = frequency.steps_for_seconds(self.every.value, self._reduce_max([self._baseline()])[0])
                self._next_at, self._decide_at = done + self._k, None
            elif self._decide_at == done:  # auto: a first checkpoint measures what one costs
                self._decide_at = None
                self._profile(done)
                extra["checkpoint_step"] = done
            if self._next_at == done:
                self._take(done, "interval")
                extra["checkpoint_step"] = done
        loop_s = time.perf_counter() - start
        self._ledger.add_thread_time(loop_s)
        if extra or loop_s + waited > 1e-4:
            extra["checkpoint_stall_s"] = loop_s + waited
        return extra

    def _baseline(self) -> float:
        """A step's time far from any checkpoint (:attr:`.frequency.CostLedger.reference_s`)."""
        return self._ledger.reference_s

    def _reduce_max(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.world > 1:
            comm.all_reduce(t, self.control, op=dist.ReduceOp.MAX, purpose="checkpoint_timing")
        return t.tolist()

    def _profile(self, done: int) -> None:
        """auto's first checkpoint. Overlapped like every other (the training thread does not wait
        for its write); ``k`` is decided once every rank's write has finished. An asynchronous
        pipeline decides its next drain at the start of a segment, so it waits for this one."""
        self._ledger.started()
        self._start_checkpoint(done, "auto-profile")
        self._profiling = done
        if getattr(self.trainer.executor, "is_async", False):
            self._join()
            self._profiled(done)

    def _profiled(self, done: int) -> None:
        """While the profiling checkpoint is written: once it is complete on every rank (a one-number
        all-reduce per step, on the control group), decide ``k``."""
        finished = self._thread is None or not self._thread.is_alive()
        if self._reduce_max([0.0 if finished else 1.0])[0] > 0:
            return
        self._join()
        self._profiling = None
        self._decide(done, starting=False)
        self._next_at = done + self._k

    def _decide(self, done: int, *, starting: bool) -> None:
        """auto: ``k`` from the costs measured so far (:func:`.frequency.budget_interval`), the same on
        every rank (the maximum of the ranks' measurements). ``starting``: a checkpoint starts at
        ``done`` too, whose cost is not measured yet but will be spent: count it at the mean."""
        last = self._last or {}
        t = self.trainer.train
        # the mean cost of a checkpoint so far, each over its whole interval (CostLedger)
        mean = self._ledger.mean_cost_s()
        base, cost, full, spent, least = self._reduce_max([
            self._baseline(), mean, last.get("snapshot_s", 0.0) + last.get("persist_s", 0.0),
            self._ledger.spent_s + (mean if starting else 0.0), float(self._ledger.min_interval)])
        k = frequency.budget_interval(base, cost, full, spent_s=spent, steps_total=t.steps - self._start,
                                      steps_left=t.steps - done, bound=self.bound * frequency.AIM)
        k = max(k, int(least))  # far steps in every interval, to keep the reference true
        past = spent - (cost if starting else 0.0)  # measured, without the one starting now
        self.last_overhead = past / ((done - self._start) * base) if base > 0 and done > self._start else None
        if k != self._k:
            so_far = "" if self.last_overhead is None else f", so far {100 * self.last_overhead:.1f}%"
            self.say(f"checkpoint interval: every {k} steps (auto: step {base:.3g} s, cost {cost:.3g} s a "
                     f"checkpoint, write {full:.3g} s, bound {100 * self.bound:g}% of the run{so_far})")
        self._k = k

    def _take(self, done: int, reason: str) -> None:
        self._join()  # at most one in flight
        self._ledger.started()  # the previous checkpoint's interval, and so its cost, ends here
        if self.every.kind == "auto":
            self._decide(done, starting=True)
        elif self.every.kind == "seconds":
            self._k = frequency.steps_for_seconds(self.every.value, self._reduce_max([self._baseline()])[0])
        self._start_checkpoint(done, reason)
        self._next_at = done + (int(self.every.value) if self.every.kind == "steps" else self._k)

    def _start_checkpoint(self, done: int, reason: str) -> None:
        tr = self.trainer
        cap = state.capture(tr)
        c = tr.config
        manifest = {"step": done, "reason": reason, "model": tr.spec.name, "model_spec": tr.spec.to_dict(),
                    "parallel": c.to_dict(), "dp_impl": tr.train.dp_impl, "world_size": self.world,
                    "seed": tr.train.seed, "steps": tr.train.steps, "created_unix_s": time.time(),
                    "lr": lr_at(min(done, tr.train.steps - 1), tr.train)}  # of the next step
        self._inflight = {"step": done, "started": time.perf_counter()}
        self._snapshotted.clear()
        self.say(f"checkpoint step {done}: snapshot started ({reason})")
        self._thread = threading.Thread(target=self._write, args=(cap, manifest), name="checkpoint", daemon=True)
        self._thread.start()

    def _write(self, cap: state.Capture, manifest: dict[str, Any]) -> None:
        done = manifest["step"]
        info = self._inflight
        assert info is not None
        try:
            if state.ONE_THREAD_SNAPSHOT:
                state.one_thread_here()  # no OpenMP team of its own beside training's threads
            t0 = time.perf_counter()
            dest = self.writer.arena(*state.layout(cap))
            state.snapshot_into(cap, dest, halfway=lambda: faults.maybe_inject_checkpoint_fault(self.rank, done,
                                                                                               "snapshot"))
            info["snapshot_s"] = time.perf_counter() - t0
            self._snapshotted.set()
            answer = self.writer.persist({"path": str(store.step_dir(self.root, done)), "step": done,
                                          "manifest": manifest, "keep": self.keep, "rank_pid": os.getpid()})
            info.update({k: answer[k] for k in ("persist_s", "size_bytes", "pruned") if k in answer})
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread at the next join
            self._error = e
        finally:
            self._snapshotted.set()

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._snapshotted.is_set():
            t0 = time.perf_counter()
            self._snapshotted.wait()
            waited = time.perf_counter() - t0
            self._stall_s += waited
            if self._inflight is not None:
                self._inflight["wait_s"] = self._inflight.get("wait_s", 0.0) + waited

    def _poll(self) -> None:
        if self._thread is not None and not self._thread.is_alive():
            self._join()

    def _join(self) -> None:
        if self._thread is None:
            return
        t0 = time.perf_counter()
        self._thread.join()
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        info = self._inflight or {}
        self._inflight = None
        info["stall_s"] = info.get("wait_s", 0.0) + (time.perf_counter() - t0)
        self._last = info
        self.saved.append(info["step"])
        size = info.get("size_bytes")
        self.say(f"checkpoint step {info['step']} complete" + (f": {size / 2**20:.2f} MiB" if size else "") +
                 f", snapshot {info.get('snapshot_s', 0):.3f} s, persist {info.get('persist_s', 0):.3f} s"
                 + (f", pruned {len(info['pruned'])}" if info.get("pruned") else ""))

    # ----- end of run -------------------------------------------------------------------------------
    def finish(self, steps: int) -> None:
        """The final checkpoint (the last step's state), written before returning."""
        if steps not in self.saved and (self._inflight or {}).get("step") != steps:
            self._join()
            self._start_checkpoint(steps, "final")
        self._join()
        self.close()

    def close(self) -> None:
        """Stop the writer process and remove the optimizer hook (after :meth:`finish`, or when the
        run stops early; a writer also dies with its rank)."""
        self.writer.close()
        self._hook.remove()

    @property
    def writer_cpu_s(self) -> float:
        """CPU seconds the writer process spent on checkpoints so far (its start-up not included)."""
        return self.writer.cpu_s - self.writer.startup_cpu_s

