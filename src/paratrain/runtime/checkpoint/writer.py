"""The persist phase in a process of its own: DCP's save of a snapshot, the marker, pruning.

Why a process: a writer *thread* shares the training process's GIL, and DCP's planning and
serialization of every tensor is Python; on a small machine the steps beside a write were measurably
slower (README, CheckFreq section). The writer process runs at nice +:data:`WRITER_NICE` with one
torch thread, so on a busy machine training keeps the cores first.

No tensor data crosses a pipe. The snapshot lives in shared memory: one file per tensor under
``/dev/shm``, created and filled by the rank (the snapshot phase copies into it), mapped by its
writer, then unlinked (nothing is left in ``/dev/shm`` when either process dies). The files are
made once for a run's state layout and reused by every checkpoint. Messages over a socket pair are
small pickled dicts.

The writers of all ranks form a gloo group of their own (a TCPStore served by rank 0's training
process), so DCP's collectives never meet training's. A DTensor's local piece reaches the writer
as a plain tensor with its global size and offsets (:class:`_Shard`), which DCP's planner takes as
it takes a DTensor: the files are the ones a DCP save of the DTensors would write.

A writer dies with its rank (``PR_SET_PDEATHSIG``, and end of file on its socket); a rank whose
writer died gets an error naming it at the next join, never a hang.

Run as ``python -m paratrain.runtime.checkpoint.writer FD`` by :class:`WriterProcess` only.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["WriterProcess", "WriterDied", "WRITER_NICE", "WRITER_PRIORITY", "ZIP_CRC32", "cpu_s"]

WRITER_NICE = 10  # the writer's niceness: on a busy machine training keeps the cores first
# "idle": SCHED_IDLE instead (the writer runs only on a core nothing else wants); read when a
# WriterProcess starts, so a bench can compare settings
WRITER_PRIORITY: int | str = WRITER_NICE
# torch.save's zip records carry a CRC-32 each, computed byte by byte (about half the writer's CPU
# on DCP's tensor files); the marker's checksum already covers every file, so the writer skips it
# (torch.load does not check it). A bench sets True to compare.
ZIP_CRC32 = False
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 0.5  # how often a rank waiting for its writer checks that it is alive
_STOP_S = 30.0  # a stopped writer's time to exit (generous: on a loaded machine it runs at nice +10)


class WriterDied(ConnectionError):
    """The writer process of this rank exited or failed (the message says which, and how). A
    ConnectionError: the rank lost the process it hands its checkpoints to, a fault and not a bug, so
    the run ends with one line and no traceback (:func:`paratrain.runtime.faults.guard`)."""


def cpu_s() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class WriterProcess:
    """This rank's writer process (module docstring). Construct on every rank at once (rank 0
    serves the writers' rendezvous; ``control``: a gloo group of the training processes), on a
    thread that lives as long as the run: Linux's parent-death signal follows the creating thread."""

    def __init__(self, rank: int, world: int, control: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._store = None
        host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), 0
        if world > 1:
            if rank == 0:
                self._store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                                            wait_for_workers=False)
                port = self._store.port
            from paratrain.runtime.comm import layer as comm

            t = torch.tensor([port], dtype=torch.int64)
            comm.all_reduce(t, control, op=dist.ReduceOp.MAX, purpose="checkpoint_writers")
            port = int(t.item())
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        pkg_root = str(Path(__file__).resolve().parents[3])  # the directory holding paratrain/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                     pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._finalizer = weakref.finalize(self, _stop, self.proc, self._conn)
        self._conn.send({"rank": rank, "world": world, "host": host, "port": port, "timeout_s": timeout_s,
                         "parent_pid": os.getpid(), "priority": WRITER_PRIORITY,
                         "digest": _store_digest(), "zip_crc32": ZIP_CRC32})
        self._ready: dict[str, Any] | None = None
        self._layout: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None
        self._shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._files: dict[str, int] = {}  # shared-memory file of each tensor, open until the writer mapped it
        self.tensors: dict[str, torch.Tensor] = {}  # the shared-memory snapshot, by key
        self._mapped = False
        self.cpu_s = 0.0  # the writer's CPU seconds, as of its last answer
        self.startup_cpu_s = 0.0  # of which start-up (interpreter, torch, gloo group)

    # ----- the rank's side --------------------------------------------------------------------------
    def wait_ready(self) -> None:
        """Wait until the writer has started and joined its group (at most once)."""
        if self._ready is None:
            self._ready = self._recv("starting")
            self.cpu_s = self.startup_cpu_s = self._ready["cpu_s"]

    def arena(self, layout: list[tuple[str, tuple[int, ...], torch.dtype]],
              shards: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """Shared-memory tensors for ``layout`` ((key, local shape, dtype) of everything saved),
        made once and reused while the layout stays. ``shards``: for the DTensors' local pieces,
        (global size, offsets) by key. The writer maps them at the next :meth:`persist`."""
        if layout != self._layout:
            self._close_files()
            _allow_files(len(layout))
            self.tensors = {}
            for key, shape, dtype in layout:
                self.tensors[key], fd = _shm_tensor(shape, dtype)
                if fd is not None:
                    self._files[key] = fd
            self._layout, self._shards, self._mapped = layout, dict(shards), False
        return self.tensors

    def persist(self, request: dict[str, Any]) -> dict[str, Any]:
        """Have the writer save the shared-memory snapshot (blocks; call off the training thread).
        ``request``: ``path``, ``step``, ``manifest``, ``keep``. Returns the writer's answer
        (``persist_s``, ``size_bytes``, ``pruned``, ``cpu_s``); raises :class:`WriterDied`."""
        self.wait_ready()
        doing = f"writing checkpoint step {request['step']}"
        if not self._mapped:
            files = {key: (f"/proc/{os.getpid()}/fd/{fd}", tuple(self.tensors[key].shape), self.tensors[key].dtype)
                     for key, fd in self._files.items()}
            try:
                self._send({"op": "map", "files": files, "shards": self._shards,
                            "empty": {k: (tuple(t.shape), t.dtype) for k, t in self.tensors.items() if not t.numel()}})
                self._recv(doing)
            finally:
                self._close_files()  # both processes have mapped them (or the writer is gone)
            self._mapped = True
        self._send({"op": "persist", **request})
        answer = self._recv(doing)
        self.cpu_s = answer["cpu_s"]
        return answer

    def close(self) -> None:
        """Stop the writer (after its last answer) and wait for it to exit."""
        self._close_files()
        self._finalizer()

    def _close_files(self) -> None:
        for fd in self._files.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._files = {}

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            self._conn.send(msg)
        except OSError:
            raise self._died("sending it work") from None

    def _recv(self, doing: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        try:
            while not self._conn.poll(_POLL_S):
                if self.proc.poll() is not None:
                    raise self._died(doing)
                if doing == "starting" and time.monotonic() > deadline:
                    raise WriterDied(f"the checkpoint writer of rank {self.rank} did not start within "
                                     f"{self.timeout_s:g} s")
            answer = self._conn.recv()
        except (EOFError, OSError):
            raise self._died(doing) from None
        if "error" in answer:
            raise WriterDied(f"the checkpoint writer of rank {self.rank} failed {doing}: {answer['error']}")
        return answer

    def _died(self, doing: str) -> WriterDied:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        code = self.proc.returncode
        how = "is still running" if code is None else (f"was killed by {signal.Signals(-code).name}" if code < 0
                                                        else f"exited with code {code}")
        return WriterDied(f"the checkpoint writer process of rank {self.rank} (pid {self.proc.pid}) {how} while "
                          f"{doing}; the checkpoints already complete are intact")


def _shm_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int | None]:
    """A tensor in a shared-memory file of its own (its storage is exactly the tensor, so DCP
    writes it without a copy) and a descriptor of the file, which is unlinked at once: the writer
    opens it as ``/proc/<pid>/fd/<fd>``, and nothing stays behind whoever dies. An empty tensor
    needs no file."""
    n = math.prod(shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype), None
    path = os.path.join(_shm_dir(), f"paratrain-ckpt-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        t = torch.from_file(path, shared=True, size=n, dtype=dtype).view(shape)
        fd = os.open(path, os.O_RDWR)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return t, fd


def _allow_files(n: int) -> None:
    """Room for ``n`` more open files (one per tensor until the writer maps them)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n + 512:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (n + 512 if hard == resource.RLIM_INFINITY
                                                        else min(hard, n + 512), hard))


def _stop(proc: subprocess.Popen[bytes], conn: Connection) -> None:
    with contextlib.suppress(OSError, ValueError):
        conn.send({"op": "stop"})
    with contextlib.suppress(OSError):
        conn.close()
    try:
        proc.wait(timeout=_STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ----- the writer's side -------------------------------------------------------------------------------
class _Shard:
    """A DTensor's local piece as DCP's planner asks it of a DTensor (the ``_Checkpointable``
    methods), without the device mesh a writer process does not have."""

    def __init__(self, local: torch.Tensor, size: tuple[int, ...], offsets: tuple[int, ...]) -> None:
        self.local, self.size, self.offsets = local, torch.Size(size), torch.Size(offsets)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=self.offsets,
                                                                                 sizes=self.local.size()),
                                                      properties=TensorProperties.create_from_tensor(self.local),
                                                      size=self.size))]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=self.offsets, sizes=self.local.size())]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self.local


def _planner() -> Any:
    from torch.distributed.checkpoint import DefaultSavePlanner

    class ShardPlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            obj = self.state_dict[index.fqn]
            return obj.local if isinstance(obj, _Shard) else super().lookup_object(index)

    return ShardPlanner()


def _die_with(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies (Linux); elsewhere the socket's end of file."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)


def _store_digest() -> str:
    from . import store

    return store.DIGEST


def _lower_priority(priority: int | str) -> None:
    """``nice`` by ``priority``, or SCHED_IDLE for ``"idle"`` (where the platform has it)."""
    with contextlib.suppress(OSError, AttributeError):
        if priority == "idle":
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        elif int(priority):
            os.nice(int(priority))


def _persist(msg: dict[str, Any], state: dict[str, Any], rank: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from paratrain.runtime import faults

    from . import store

    t0 = time.perf_counter()
    path, done = Path(msg["path"]), msg["step"]
    if rank == 0 and path.exists():  # a leftover of an earlier run; no rank writes before rank 0 plans
        shutil.rmtree(path)
    writer = FileSystemWriter(str(path), sync_files=True, single_file_per_rank=True, thread_count=1)
    dcp.save(state, storage_writer=writer, planner=_planner())
    faults.maybe_inject_checkpoint_fault(rank, done, "persist", pid=msg["rank_pid"])
    answer: dict[str, Any] = {}
    if rank == 0:
        store.write_marker(path, msg["manifest"], before_rename=lambda: faults.maybe_inject_checkpoint_fault(
            rank, done, "marker", pid=msg["rank_pid"]))
        answer["pruned"] = [str(p) for p in store.prune(path.parent, msg["keep"])]
        answer["size_bytes"] = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    answer["persist_s"] = time.perf_counter() - t0
    return answer


def _serve(conn: Connection) -> None:
    cfg = conn.recv()
    _die_with(cfg["parent_pid"])
    _lower_priority(cfg.get("priority", WRITER_NICE))
    from . import store as checkpoint_store

    checkpoint_store.DIGEST = cfg.get("digest", checkpoint_store.DIGEST)
    torch.serialization.set_crc32_options(bool(cfg.get("zip_crc32", ZIP_CRC32)))
    torch.set_num_threads(1)
    rank, world = cfg["rank"], cfg["world"]
    timeout = datetime.timedelta(seconds=cfg["timeout_s"])
    try:
        if world > 1:
            store: Any = dist.PrefixStore("paratrain-checkpoint-writers/",
                                          dist.TCPStore(cfg["host"], cfg["port"], None, False, timeout=timeout))
        else:
            store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - reported to the rank, which fails with it
        conn.send({"error": f"joining the writers' group: {str(e).strip().splitlines()[0] if str(e) else e!r}"})
        return
    conn.send({"ready": True, "cpu_s": cpu_s()})
    state: dict[str, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break  # the rank is gone
        if msg["op"] == "stop":
            break
        try:
            if msg["op"] == "map":
                state = {}
                for key, (name, shape, dtype) in msg["files"].items():
                    t = torch.from_file(name, shared=True, size=math.prod(shape), dtype=dtype).view(shape)
                    shard = msg["shards"].get(key)
                    state[key] = _Shard(t, *shard) if shard else t
                for key, (shape, dtype) in msg["empty"].items():
                    state[key] = torch.empty(shape, dtype=dtype)
                answer: dict[str, Any] = {}
            else:
                answer = _persist(msg, state, rank)
        except Exception as e:  # noqa: BLE001 - reported to the rank, which fails with it
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            answer = {"error": f"{type(e).__name__}: {text}"}
        answer["cpu_s"] = cpu_s()
        conn.send(answer)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
