"""Turning failures into one clear line per rank, and fault injection for tests.

Every failure of a multi-process job must end it within the configured timeout with one message
on every surviving rank, never a silent hang:
- bad input (:class:`ConfigError`): ``[rank r] error: <field>: <problem> (fix: ...)``, exit code 2;
- a peer that died or stopped answering: the collective raises (gloo notices a closed socket at
  once; otherwise the process-group timeout fires), exit code 1;
- a rendezvous that cannot be reached within the timeout, exit code 1;
- SIGTERM from the launcher (torchrun ends the others when one worker fails), exit code 143;
- an interrupt (Ctrl-C, SIGTERM to ``paratrain train --nproc N``): the launcher prints one line
  and passes SIGINT on, which ends a worker at once and silently (the default action); a single
  process (no launcher) prints ``paratrain: interrupted (SIGINT)`` itself, exit 128 + signal.
The process leaves with ``os._exit`` after flushing: tearing down a process group whose peers
are gone can itself block.

Fault injection: ``PARATRAIN_FAULT=kill:RANK:STEP`` makes global rank RANK kill itself with
SIGKILL in step STEP, after the forward of its first micro-batch (tests/runtime/test_runtime_faults.py);
``PARATRAIN_FAULT=kill-checkpoint:RANK:STEP:PHASE`` while it writes a checkpoint
(:func:`maybe_inject_checkpoint_fault`, tests/runtime/test_checkpoint_atomicity.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator

from paratrain.errors import ConfigError

from .mesh import RendezvousError

__all__ = ["rank_prefix", "log", "fail_and_exit", "explain_failure", "maybe_inject_fault", "guard",
           "signal_handlers", "Interrupted", "FAULT_ENV", "maybe_inject_checkpoint_fault", "CHECKPOINT_PHASES"]

FAULT_ENV = "PARATRAIN_FAULT"
STOP_GRACE_S = 1.0  # a worker's wait, on SIGTERM, for the launcher's SIGINT of an interrupted job
# How long a lone process, once interrupted, may stay inside one native call (a huge attention
# kernel) before it is ended without reaching Python again; PARATRAIN_STOP_AFTER_S overrides it.
STOP_AFTER_S = 10.0


def rank_prefix(rank: int) -> str:
    return f"[rank {rank}]"


def log(rank: int, message: str, *, err: bool = False) -> None:
    print(f"{rank_prefix(rank)} {message}", file=sys.stderr if err else sys.stdout, flush=True)


def fail_and_exit(rank: int, message: str, code: int) -> None:
    log(rank, f"error: {message}", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def explain_failure(exc: BaseException, *, phase: str, timeout_s: float) -> str:
    """One line saying what went wrong during ``phase``, keeping the library's first line as cause."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = text.split(" This is typically caused")[0]  # gloo's generic advice after the actual error
    low = str(exc).lower()
    if "timed out" in low or "timeout" in low or isinstance(exc, TimeoutError):
        reason = f"no answer from a peer rank within the {timeout_s:g} s timeout (a rank died or hangs)"
    elif any(k in low for k in ("connection", "closed", "reset by peer", "broken pipe", "peer", "eof")):
        reason = "a peer rank disconnected (it died or was killed)"
    else:
        reason = f"{type(exc).__name__}"
    return f"job aborted during {phase}: {reason}; cause: {text[:300]}"


def maybe_inject_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec.startswith("kill:"):
        return
    _, r, s = spec.split(":")
    if int(r) == rank and int(s) == step:
        log(rank, f"fault injection: killing this rank at step {step}", err=True)
        os.kill(os.getpid(), signal.SIGKILL)


CHECKPOINT_PHASES = ("snapshot", "persist", "marker")


def maybe_inject_checkpoint_fault(rank: int, step: int, phase: str, *, pid: int | None = None) -> None:
    """``PARATRAIN_FAULT=kill-checkpoint:RANK:STEP:PHASE``: SIGKILL global rank RANK while it writes
    the checkpoint of step STEP, in PHASE: ``snapshot`` (half the host copies made), ``persist``
    (data files written, no marker) or ``marker`` (marker written, not yet renamed into place).
    ``pid``: the rank's process, when the caller is its checkpoint writer process (killed too)."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec.startswith("kill-checkpoint:"):
        return
    _, r, s, ph = spec.split(":")
    if int(r) == rank and int(s) == step and ph == phase:
        log(rank, f"fault injection: killing this rank during the {phase} of checkpoint step {step}", err=True)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached a process that stops by itself (no launcher to report it).

    A BaseException, like KeyboardInterrupt: no ``except Exception`` on the way up swallows it.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"interrupted ({signal.Signals(signum).name})")


@contextlib.contextmanager
def signal_handlers(rank: int, *, alone: bool) -> Iterator[None]:
    """SIGINT and SIGTERM of a worker while the block runs (``alone``: the only process, run in
    the CLI's own process, which gets its handlers back afterwards)."""
    def _interrupt(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    def _stopped(signum: int, frame: object) -> None:
        # SIGTERM to the whole process group (an interrupted job) reaches the launcher too, which
        # then sends SIGINT: wait for it, so that only a launcher stopping the job for a failed
        # rank leaves this line.
        time.sleep(STOP_GRACE_S)
        fail_and_exit(rank, "stopped by the launcher (another rank failed or the job was interrupted)", 143)

    # Under a launcher an interrupt is the launcher's to report (its process group gets Ctrl-C
    # too): end at once, without a word, even inside a collective that would not return to Python.
    handlers = {signal.SIGINT: _interrupt, signal.SIGTERM: _interrupt} if alone else \
        {signal.SIGINT: signal.SIG_DFL, signal.SIGTERM: _stopped}
    before = {s: signal.signal(s, h) for s, h in handlers.items()}
    try:
        with _ended_if_stuck(_stop_after_s()) if alone else contextlib.nullcontext():
            yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _stop_after_s() -> float:
    raw = os.environ.get("PARATRAIN_STOP_AFTER_S")
    try:
        value = float(raw) if raw else STOP_AFTER_S
    except ValueError:
        value = STOP_AFTER_S
    return value if value > 0 else STOP_AFTER_S


@contextlib.contextmanager
def _ended_if_stuck(after_s: float) -> Iterator[None]:
    """End the process ``after_s`` after SIGINT or SIGTERM (at once on a second one) if the Python
    handler has not ended it by then.

    A Python signal handler runs only between bytecodes of the main thread, so a process inside
    one long native call (a torch kernel over a huge tensor) would not stop until the call
    returns. CPython's C-level handler also writes the signal's number to the wakeup fd at once,
    whatever the main thread is doing; a watcher thread waits on it.
    """
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    done = threading.Event()

    def watch() -> None:
        first: int | None = None
        deadline = 0.0
        while not done.is_set():
            reader.settimeout(None if first is None else max(0.0, deadline - time.monotonic()))
            try:
                data = reader.recv(64)
            except (TimeoutError, OSError):
                data = None
            if done.is_set() or data == b"":
                return
            stops = [n for n in data or b"" if n in (signal.SIGINT, signal.SIGTERM)]
            if first is None:
                if stops:
                    first, deadline = stops[0], time.monotonic() + after_s
                continue
            if data is None or stops:  # the wait ran out, or a second interrupt came
                signum = stops[0] if stops else first
                print(f"paratrain: interrupted ({signal.Signals(signum).name}); stopped inside a long"
                      " computation", file=sys.stderr, flush=True)
                os._exit(128 + signum)

    watcher = threading.Thread(target=watch, name="paratrain-stop-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        writer.close()  # the watcher's recv returns b"" and it ends
        watcher.join(timeout=5)
        reader.close()


class Phase:
    """What the rank is doing, for the failure message."""

    def __init__(self) -> None:
        self.name = "start-up"


@contextlib.contextmanager
def guard(rank: int, phase: Phase, timeout_s: float, *, alone: bool = False) -> Iterator[None]:
    """Run a worker's body; any failure becomes one line on stderr and a clean exit code.

    ``alone`` (one process, no launcher): bad input propagates as :class:`ConfigError` to the CLI,
    which prints its usual one-line error; there are no peers to abandon.
    """
    try:
        yield
    except ConfigError as e:
        if alone:
            raise
        fail_and_exit(rank, str(e), 2)
    except RendezvousError as e:
        fail_and_exit(rank, str(e), 1)
    except (Interrupted, KeyboardInterrupt) as e:
        if not alone:
            fail_and_exit(rank, "interrupted", 130)
        sig = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        print(f"paratrain: interrupted ({signal.Signals(sig).name})", file=sys.stderr, flush=True)
        raise SystemExit(128 + sig) from None
    except Exception as e:  # noqa: BLE001 - every error must end the rank with one clear line
        message = explain_failure(e, phase=phase.name, timeout_s=timeout_s)
        if not is_communication_failure(e):
            traceback.print_exc()  # a bug, not a fault: keep the traceback above the summary line
        fail_and_exit(rank, message, 1)


def is_communication_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    kinds = tuple(k for k in (getattr(dist, "DistError", None),) if k is not None)
    low = str(exc).lower()
    return isinstance(exc, kinds + (TimeoutError, ConnectionError)) or any(
        k in low for k in ("timed out", "timeout", "connection", "closed", "reset by peer", "broken pipe", "gloo",
                           "nccl"))
