"""Worker processes forked from a server that imported the runtime once.

A spawned worker starts a fresh interpreter and imports torch, DTensor and the pipelining module
again (~2.3 s of CPU each on the 2-core development machine); a worker forked from a
multiprocessing fork server that preloaded them starts at once. The server is started before any
CUDA or thread state exists in it, so forking from it is safe where forking the launcher is not.

:func:`forked_workers` stops the server when the workers are done and waits for it, so the
workers' CPU time is counted as the launcher's children's (``/usr/bin/time``, ``os.times``): a
server left running is reaped by no one and its children's time is lost to those tools. The
server lives as long as any process it forked (each holds its "alive" pipe), so a worker that
outlived the launcher's shutdown — one forked in the instant a Ctrl-C reached the process group,
before the launcher knew its pid, then waiting in a rendezvous for peers that are gone — would
keep the launcher waiting for the server until the worker's own timeout. So every worker calls
:func:`worker_started` first (it dies with the server), and the launcher kills a server that has
not ended ``grace_s`` after the workers were done.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator
from multiprocessing.context import BaseContext

__all__ = ["forked_workers", "worker_started"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_GRACE_S = 5.0


@contextlib.contextmanager
def forked_workers(preload: list[str], grace_s: float = STOP_GRACE_S) -> Iterator[BaseContext]:
    """A ``forkserver`` multiprocessing context whose server imports ``preload`` when it starts."""
    multiprocessing.set_forkserver_preload(preload)
    try:
        yield multiprocessing.get_context("forkserver")
    finally:
        _stop_server(grace_s)


def worker_started() -> None:
    """First call in a forked worker. It dies with the fork server (Linux), and its own
    subprocesses (a DataLoader's workers) start by the platform's default method, as in a process
    that ``torchrun`` starts: a fork server's child inherits ``forkserver`` as its default, which
    would start them from a server of its own that has imported nothing."""
    multiprocessing.set_start_method(None, force=True)
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the server died before the request took effect
            os._exit(1)


def _stop_server(grace_s: float) -> None:
    """Close the server's "alive" pipe (it ends once no process it forked is left), wait up to
    ``grace_s`` for it, then kill it (its workers die with it), and reap it. The fields are the
    standard library's ``ForkServer`` (its ``_stop`` does the same with an unbounded wait)."""
    from multiprocessing import forkserver, util

    server = forkserver._forkserver
    if not all(hasattr(server, f) for f in ("_lock", "_forkserver_pid", "_forkserver_alive_fd",
                                             "_forkserver_address")):
        return  # another Python's fork server: leave it running
    with server._lock:
        pid = server._forkserver_pid
        if pid is None:
            return
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
        deadline = time.monotonic() + grace_s
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.02)
        server._forkserver_pid = None
        address = server._forkserver_address
        if address and not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                os.unlink(address)
        server._forkserver_address = None
