"""Launching several local worker processes through torch's elastic launcher (the machinery
behind ``torchrun``), and the Python entry point :func:`run_training`.

``paratrain train --nproc N`` and :func:`run_training` call :func:`launch`, which starts N workers
with ``torch.distributed.launcher.api.elastic_launch`` on a free local port (c10d rendezvous on
127.0.0.1, no restarts) and returns rank 0's per-step metrics. A failed worker makes the agent stop
the others (each prints why) and :func:`launch` raises :class:`LaunchError` naming the first
failed rank. SIGINT or SIGTERM to the launcher stops every worker (the agent sends them SIGINT,
which ends a worker at once and silently, then SIGKILL after ``shutdown_timeout``) and raises
:class:`Interrupted`, which the CLI prints as one line (exit 128 + signal).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig
from paratrain.spec.model import ModelSpec, resolve_model

from .forkserver import forked_workers, worker_started
from .mesh import check_world_size, runtime_device
from .train import TrainConfig, validate_run, worker_main

__all__ = ["Interrupted", "LaunchError", "TrainResult", "free_port", "launch", "run_training"]


class LaunchError(RuntimeError):
    """A worker failed; ``exit_code`` is the first failed rank's."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Interrupted(RuntimeError):
    """The launcher got SIGINT or SIGTERM and stopped the workers; ``exit_code`` = 128 + signal."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"interrupted ({signal.Signals(signum).name}), workers stopped")


# Seconds a worker gets to end after the agent's signal before SIGKILL (SIGINT ends it at once).
SHUTDOWN_TIMEOUT_S = 10


@dataclass(frozen=True)
class TrainResult:
    """Per-step metrics of rank 0 (the global-batch loss is the same on every rank)."""

    rows: tuple[dict[str, Any], ...]

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.rows]

    @property
    def tokens_per_s(self) -> list[float]:
        return [r["tokens_per_s"] for r in self.rows]


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux's
    ``ip_local_port_range``; 32768, its default, where that cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port for a rendezvous, below the ephemeral range: a port bound and released
    here stays free until the store binds it, except that the kernel may hand an ephemeral one to
    any outgoing connection meanwhile (gloo opens one per pair of ranks), which then fails the
    store with EADDRINUSE. Random among 16k ports, so that concurrent launches rarely pick alike."""
    import random

    low = _ephemeral_low()
    if low > 2048:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(max(1024, low - 16384), low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What the elastic agent sets in each worker's environment (torch's LocalElasticAgent).
_AGENT_ENV = frozenset({"LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
                        "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"})
_AGENT_ENV_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_")


def _sync_environ(launcher_env: dict[str, str]) -> None:
    """Give a worker the launcher's environment as it is now. Workers fork from a server process
    started at the first launch, so they inherit its environment from then; a caller that changed
    ``os.environ`` between two launches in one process expects the change to reach the workers. The
    agent's own per-worker variables stay."""
    for key in set(os.environ) | set(launcher_env):
        if key in _AGENT_ENV or key.startswith(_AGENT_ENV_PREFIXES):
            continue
        if key in launcher_env:
            os.environ[key] = launcher_env[key]
        else:
            del os.environ[key]


def _elastic_entry(spec_dict: dict[str, Any], config_dict: dict[str, Any], train_dict: dict[str, Any],
                   threads: int | None, launcher_env: dict[str, str]) -> list[dict[str, Any]]:
    worker_started()
    _sync_environ(launcher_env)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    train_dict = {**train_dict, "betas": tuple(train_dict["betas"])}
    return worker_main(ModelSpec(**spec_dict), ParallelConfig.from_dict(config_dict), TrainConfig(**train_dict))


def launch(spec: ModelSpec, config: ParallelConfig, train: TrainConfig, nproc: int,
           *, threads_per_proc: int | None = None) -> TrainResult:
    """Run ``nproc`` local workers and return rank 0's metrics (raises :class:`LaunchError`)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    check_world_size(config, nproc)
    validate_run(spec, config, train, procs_on_host=nproc)
    runtime_device(nproc)  # a PARATRAIN_DEVICE the node cannot honour: one error line before any worker starts
    if threads_per_proc is None:
        # Share the cores instead of oversubscribing them (torchrun sets OMP_NUM_THREADS=1).
        threads_per_proc = max(1, (os.cpu_count() or 1) // nproc)
    # LaunchConfig took shutdown_timeout only in later torch releases (2.11 lacks it)
    extra = ({"shutdown_timeout": SHUTDOWN_TIMEOUT_S}
             if "shutdown_timeout" in inspect.signature(LaunchConfig).parameters else {})
    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"paratrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_configs={"timeout": int(train.timeout_s)},
        max_restarts=0, monitor_interval=0.1, start_method="forkserver", local_addr="127.0.0.1",
        **extra,
        # SIGINT and SIGTERM are ours (_stop_on_signals): torch's handlers would pass SIGTERM on
        signals_to_handle="SIGHUP,SIGQUIT",
    )
    interrupted: list[int] = []
    try:
        # workers fork from a server that imported the runtime once (runtime/forkserver.py)
        with _quiet_agent(), _stop_on_signals(interrupted), forked_workers(["paratrain.runtime.train"]):
            results = elastic_launch(lc, _elastic_entry)(spec.to_dict(), config.to_dict(), train.to_dict(),
                                                          threads_per_proc, dict(os.environ))
    except ChildFailedError as e:
        if interrupted:  # a worker that got the interrupt first and died of it
            raise Interrupted(interrupted[0]) from None
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode is not None else 1
        # A negative exit code is a signal: -9 is SIGKILL.
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise LaunchError(f"worker rank {rank} {how}; see the [rank N] lines above", 2 if code == 2 else 1) from None
    except SignalException:
        raise Interrupted(interrupted[0] if interrupted else signal.SIGINT) from None
    if interrupted:
        raise Interrupted(interrupted[0])
    return TrainResult(tuple(results[0]))


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent logs a worker's death with a traceback of its own polling code, and an interrupt
    as a warning; each rank already printed why it stopped, and the CLI prints one line for
    LaunchError or Interrupted."""
    logs = [logging.getLogger(n) for n in ("torch.distributed.elastic.multiprocessing.api",
                                           "torch.distributed.elastic.agent.server.api")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)


@contextlib.contextmanager
def _stop_on_signals(received: list[int]) -> Iterator[None]:
    """SIGINT and SIGTERM raise the agent's ``SignalException`` (it then stops the workers) with
    SIGINT as the signal it passes on, whichever arrived: a worker ends at once and silently on
    SIGINT, while SIGTERM from the agent means "another rank failed" and is reported by each rank.
    The first signal is recorded in ``received``; later ones (a second Ctrl-C) do not interrupt the
    shutdown. A Ctrl-C that reaches a worker while it still imports torch (the first seconds) ends
    it with Python's KeyboardInterrupt traceback: spawned processes start with default signal
    handling whatever this process sets.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can only be set from the main thread; torch's agent then has its own
        return
    from torch.distributed.elastic.multiprocessing import SignalException

    def _handler(signum: int, frame: object) -> None:
        if received:
            return
        received.append(signum)
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.SIGINT)

    # the launcher records its signal list in the environment: leave this process's as it was
    env_key = "TORCHELASTIC_SIGNALS_TO_HANDLE"
    env_before = os.environ.get(env_key)
    before = {s: signal.signal(s, _handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        if env_before is None:
            os.environ.pop(env_key, None)
        else:
            os.environ[env_key] = env_before


def run_training(model: ModelSpec | str, config: ParallelConfig | None = None, *, steps: int = 20,
                 nproc: int | None = None, **train_options: Any) -> TrainResult:
    """Train ``model`` for ``steps`` steps on ``config.world_size`` local processes; returns the metrics.

    ``model`` is a ModelSpec or a preset name/file; ``train_options`` are :class:`TrainConfig`
    fields (``seed``, ``lr``, ``data``, ``bf16``, ``metrics``, ``trace``, ``progress`` …). Example::

        from paratrain.runtime import run_training
        result = run_training("gpt-tiny", ParallelConfig(dp=2, tp=2, global_batch=8), steps=10)
        print(result.losses)
    """
    spec = resolve_model(model) if isinstance(model, str) else model
    config = config if config is not None else ParallelConfig()
    nproc = config.world_size if nproc is None else nproc
    if nproc != config.world_size:
        raise ConfigError("nproc", f"{nproc} processes for a layout of dp({config.dp})*tp({config.tp})*pp({config.pp})"
                          f"={config.world_size}", f"use nproc={config.world_size}")
    return launch(spec, config, TrainConfig(steps=steps, **train_options), nproc)
