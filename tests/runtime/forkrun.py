"""Run a worker script on N local processes with torchrun's environment, forked from one server
that imported the runtime once.

``python tests/runtime/forkrun.py --nproc N SCRIPT ARGS...`` gives each rank what
``python -m torch.distributed.run --nproc-per-node N SCRIPT ARGS...`` gives it (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; the script
runs as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]``) and, like torchrun, stops the other ranks
when one fails and exits with the first failed rank's code. The tests' harnesses initialise their
process groups from that environment, so they run unchanged. The difference is the start: torchrun
starts each rank as a fresh interpreter that imports torch, DTensor and the pipelining module again
(~2.3 s of CPU per rank), while here the ranks fork from a multiprocessing server that imported
them once. On a 2-core CI machine that is most of a small launch.

:func:`command` builds the command line for ``subprocess.run``.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
from pathlib import Path

from paratrain.runtime.forkserver import forked_workers, worker_started
from paratrain.runtime.launch import free_port

PRELOAD = ["paratrain.runtime.train"]


def command(nproc: int, script: str | Path, *args: str) -> list[str]:
    """The command line that runs ``script`` on ``nproc`` ranks."""
    return [sys.executable, str(Path(__file__).resolve()), "--nproc", str(nproc), str(script), *map(str, args)]


def _rank_main(rank: int, world: int, port: int, script: str, args: list[str]) -> None:
    # dies with the server instead of waiting in a collective forever; subprocesses as under torchrun
    worker_started()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args()
    port = free_port()
    # the server is stopped and reaped when the ranks are done (a rank left over dies with it)
    with forked_workers(PRELOAD) as ctx:
        procs = [ctx.Process(target=_rank_main, args=(r, ns.nproc, port, ns.script, ns.args), name=f"rank{r}")
                 for r in range(ns.nproc)]
        for p in procs:
            p.start()

        def first_failure() -> tuple[int, int] | None:
            return next(((r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)

        while (failed := first_failure()) is None and any(p.exitcode is None for p in procs):
            time.sleep(0.05)
        if failed is None:
            return 0
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
    rank, code = failed
    print(f"forkrun: rank {rank} exited with code {code}", file=sys.stderr)
    return code if code > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
