"""Worker processes forked from a server that imported the runtime once.

A spawned worker starts a fresh interpreter and imports torch, DTensor and the pipelining module
again (~2.3 s of CPU each on the 2-core development machine); a worker forked from a
multiprocessing fork server that preloaded them starts at once. The server is started before any
CUDA or thread state exists in it, so forking from it is safe where forking the launcher is not.

:func:`forked_workers` stops the server when the workers are done and waits for it, so the
workers' CPU time is counted as the launcher's children's (``/usr/bin/time``, ``os.times``): a
server left running is reaped by no one and its children's time is lost to those tools.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator
from multiprocessing.context import BaseContext

__all__ = ["forked_workers", "as_started_fresh"]


@contextlib.contextmanager
def forked_workers(preload: list[str]) -> Iterator[BaseContext]:
    """A ``forkserver`` multiprocessing context whose server imports ``preload`` when it starts."""
    multiprocessing.set_forkserver_preload(preload)
    try:
        yield multiprocessing.get_context("forkserver")
    finally:
        _stop_server()


def _stop_server() -> None:
    from multiprocessing import forkserver

    # the standard library's own stop (its tests use it): close the server's "alive" pipe, wait for it
    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def as_started_fresh() -> None:
    """In a forked worker: its own subprocesses (a DataLoader's workers) start by the platform's
    default method, as in a process that ``torchrun`` starts. A fork server's child inherits
    ``forkserver`` as its default, which would start them from a server of its own that has
    imported nothing, each then importing torch again."""
    multiprocessing.set_start_method(None, force=True)
