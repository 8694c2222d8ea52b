"""The entry point of every collective and point-to-point call of the runtime.

Each call names its operation, tensor, group, whether it is asynchronous, its parallelism axis,
what it is for (``purpose``: ``grad_bucket``, ``grad_norm``, ``loss``, ``activation`` …) and
optionally a backend ``hint``. The active :class:`CommLayer` (one per process, set by the step
loop with :func:`use`) then

* picks the communicator: the hint, else the tuning table's choice for (op, bytes, group size)
  when one is loaded, else the run's own group (:mod:`.backends`);
* times the call: a synchronous one from issue to return; an asynchronous one from issue to its
  completion, taken from a callback on the work's future where the backend offers one (gloo
  collectives) and else from the moment this rank's ``wait()`` returns or first sees it
  completed — no synchronization is added, so overlap is what it would be without the log (on
  NCCL these are the host's times, not the kernels': that would need CUDA events);
* appends a comm-log row (:class:`CommCall`) and, when the caller names one, a trace span.

Without a table and a log the layer calls ``torch.distributed`` directly: one attribute test per
call. Object collectives (``all_gather_object``, ``broadcast_object_list``) and barriers are
logged but always run on the run's own group (their sizes differ between ranks, so no size-based
choice could agree across ranks).

Mixing backends cannot deadlock (README, "Mixing backends"): the choice is a function of (op,
bytes, group size), which every member of a call sees alike (collectives move equal-sized buffers;
the two ends of a transfer agree on its size), so each communicator receives the same calls in the
same order on every member; every communicator progresses on its own (gloo's worker threads, the
GPU), so a call completes once all members have issued it, whatever another communicator is doing.
The one shared resource is the GPU: two device backends with work in flight on the same ranks can
interleave their kernels differently on different ranks, so before a call on a device backend
(NCCL) the layer waits for the logical group's calls still in flight on any other backend, and
vice versa (MCR-DL's rule). gloo beside gloo, or gloo beside NCCL on host-staged tensors, needs no
wait, so their overlap is untouched.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .backends import Shadow, check_available, check_table, needs_staging, shadow_group, torch_backend

__all__ = ["CommCall", "CommLayer", "P2P", "current", "use", "all_reduce", "all_gather", "all_gather_object",
           "broadcast", "broadcast_object_list", "reduce_scatter", "all_to_all", "batch_isend_irecv", "irecv",
           "barrier"]


class SpanRecorder(Protocol):
    def record(self, name: str, stream: str, start_s: float, end_s: float) -> None: ...


@dataclass(frozen=True)
class CommCall:
    """One row of the comm log (JSON lines, README "The comm log").

    ``kind`` uses the simulator's spelling (:class:`paratrain.sim.engine.CommRecord`): ``p2p`` for a
    send or receive, else the operation (``all_reduce``, ``all_gather`` …). ``bytes``: the buffer on
    this rank as the tuning table counts it (an all-gather's output, everything else its input or
    message). ``group``: global ranks; a transfer's is (source, destination), as the simulator's.
    ``start_s``: seconds from the run's origin (the measured trace's clock); ``time_s``: issue to
    completion. ``step``: the optimizer step (0 for everything an asynchronous pipeline runs).
    """

    kind: str
    op: str
    bytes: int
    group: tuple[int, ...]
    start_s: float
    time_s: float
    backend: str
    rank: int
    axis: str
    step: int
    purpose: str
    async_op: bool

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["group"] = list(self.group)
        return d


@dataclass(frozen=True)
class P2P:
    """One transfer of a :func:`batch_isend_irecv`: ``send`` (else receive) ``tensor`` to/from global rank ``peer``."""

    send: bool
    tensor: torch.Tensor
    peer: int
    purpose: str = ""  # the row's purpose when it differs from the batch's (activation, gradient)


class _Clock(Protocol):
    step: int

    def trace_time(self, perf_s: float) -> float: ...


class _Plain:
    """Clock of a layer without a tracer: seconds from when the layer was made."""

    def __init__(self) -> None:
        self.step = 0
        self._t0 = time.perf_counter()

    def trace_time(self, perf_s: float) -> float:
        return perf_s - self._t0


class CallHandle:
    """An asynchronous call in flight: ``wait()`` and ``is_completed()`` like torch's ``Work``; the
    row is logged once it has completed and been waited for."""

    def __init__(self, layer: CommLayer, works: list[Any], meta: tuple, start: float,
                 after: Callable[[], None] | None, span: tuple[str, SpanRecorder] | None,
                 ranks: tuple[int, ...], watch: bool = True) -> None:
        self.layer, self.works, self.meta, self.start, self.ranks = layer, works, meta, start, ranks
        self.after, self.span = after, span
        self.done_at: float | None = None
        self._waited = False
        # a synchronous call ends when it returns: only asynchronous ones need the completion callback
        if watch and (layer.logging or span is not None):
            for w in works:
                with contextlib.suppress(RuntimeError):  # works without a future (gloo send/recv)
                    w.get_future().then(self._on_done)

    def _on_done(self, fut: Any) -> None:
        now = time.perf_counter()
        self.done_at = now if self.done_at is None else max(self.done_at, now)

    def is_completed(self) -> bool:
        """Whether it has completed; a completed call is settled (logged) here, as a send that
        finished in the background may never be waited for."""
        if self._waited:
            return True
        done = all(w.is_completed() for w in self.works)
        if done:
            if self.done_at is None:
                self.done_at = time.perf_counter()
            self.wait()
        return done

    def wait(self) -> bool:
        if self._waited:
            return True
        for w in self.works:
            w.wait()
        now = time.perf_counter()
        self._waited = True
        if self.after is not None:
            self.after()
        end = now if self.done_at is None else min(self.done_at, now)
        self.layer._finish(self.meta, self.start, end, self.span)
        self.layer._settled(self)
        return True


class CommLayer:
    """Routes, times and logs the calls of one process (module docstring).

    ``clock``: the measured trace's :class:`~paratrain.runtime.metrics.Tracer` (its origin and step);
    ``log``: keep the rows (``--comm-log``); ``table``: a :class:`~.table.TuningTable` to choose
    backends; ``default_backend``: the name of the run's own groups' backend (``gloo``/``nccl``).
    """

    def __init__(self, *, rank: int | None = None, clock: _Clock | None = None, log: bool = False,
                 table: Any = None, default_backend: str | None = None, device_type: str = "cpu",
                 timeout_s: float = 300.0) -> None:
        self.rank = dist.get_rank() if rank is None and dist.is_initialized() else (rank or 0)
        self.clock: _Clock = clock if clock is not None else _Plain()
        self.logging, self.table, self.timeout_s = log, table, timeout_s
        self.default_backend = default_backend or (dist.get_backend() if dist.is_initialized() else "gloo")
        self.rows: list[CommCall] = []
        self.routing = table is not None
        self.active = log or self.routing
        self.device_type = device_type
        self._checked: set[str] = set()  # hinted backends known to run here
        if table is not None:
            check_table(table, device_type)
        # logical group (global ranks) -> calls in flight: (backend name, handle)
        self._in_flight: dict[tuple[int, ...], list[tuple[str, CallHandle]]] = {}
        self._ranks_of: dict[int, tuple[int, ...]] = {}

    # ----- helpers -------------------------------------------------------------------------------
    def ranks(self, group: dist.ProcessGroup | None) -> tuple[int, ...]:
        key = id(group)
        found = self._ranks_of.get(key)
        if found is None:
            found = tuple(range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group))
            self._ranks_of[key] = found
        return found

    def choose(self, op: str, nbytes: int, ranks: tuple[int, ...], hint: str | None = None) -> str:
        """The backend of one call: the caller's ``hint`` (a backend name, the same on every member:
        a constant at the call site), else the table's choice, else the run's own."""
        if hint is not None:
            if hint not in self._checked:
                check_available(hint, self.device_type, "hint")
                self._checked.add(hint)
            return hint
        if self.table is None:
            return self.default_backend
        return self.table.choose(op, nbytes, len(ranks)) or self.default_backend

    def _shadow(self, name: str, ranks: tuple[int, ...]) -> Shadow | None:
        """None: the run's own group serves ``name``."""
        if name == self.default_backend:
            return None
        return shadow_group(name, tuple(sorted(ranks)), self.timeout_s)

    def _order(self, name: str, ranks: tuple[int, ...]) -> None:
        """Wait for the group's calls in flight on another backend when either is a device backend."""
        pending = self._in_flight.get(ranks)
        if not pending:
            return
        on_device = _is_device(name)
        for other, handle in list(pending):
            if other != name and (on_device or _is_device(other)):
                handle.wait()

    def _settled(self, handle: CallHandle) -> None:
        ranks = handle.ranks
        pending = self._in_flight.get(ranks)
        if pending:
            self._in_flight[ranks] = [(b, h) for b, h in pending if h is not handle]

    def _finish(self, meta: tuple, start: float, end: float, span: tuple[str, SpanRecorder] | None) -> None:
        if span is not None:
            span[1].record(span[0], "comm", start, end)
        if self.logging:
            kind, op, nbytes, group, backend, axis, purpose, is_async = meta
            self.rows.append(CommCall(kind, op, nbytes, group, self.clock.trace_time(start), end - start, backend,
                                      self.rank, axis, self.clock.step, purpose, is_async))

    def _run(self, op: str, kind: str, nbytes: int, ranks: tuple[int, ...], log_group: tuple[int, ...],
             backend: str, axis: str, purpose: str, async_op: bool, issue: Callable[[], list[Any]],
             after: Callable[[], None] | None, span: tuple[str, SpanRecorder] | None) -> CallHandle | None:
        self._order(backend, ranks)
        meta = (kind, op, nbytes, log_group, backend, axis, purpose, async_op)
        start = time.perf_counter()
        works = issue()
        handle = CallHandle(self, works, meta, start, after, span, ranks, watch=async_op)
        if not async_op:
            handle.wait()
            return None
        self._in_flight.setdefault(ranks, []).append((backend, handle))
        return handle

    # ----- collectives ---------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False, axis: str = "none",
                   purpose: str = "", span: tuple[str, SpanRecorder] | None = None, hint: str | None = None) -> Any:
        if not self.active and span is None and hint is None:
            return dist.all_reduce(t, op=op, group=group, async_op=async_op)
        ranks = self.ranks(group)
        nbytes = t.numel() * t.element_size()
        backend = self.choose("all_reduce", nbytes, ranks, hint)
        shadow = self._shadow(backend, ranks)
        after = None
        if shadow is None:
            def issue() -> list[Any]:
                return [dist.all_reduce(t, op=op, group=group, async_op=True)]
        else:
            buf, after = _staged(shadow, t)

            def issue() -> list[Any]:
                opts = dist.AllreduceOptions()
                opts.reduceOp = op
                return [shadow.backend.allreduce([buf], opts)]
        return self._run("all_reduce", "all_reduce", nbytes, ranks, ranks, backend, axis, purpose, async_op, issue,
                         after, span)

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                   async_op: bool = False, axis: str = "none", purpose: str = "", hint: str | None = None) -> Any:
        if not self.active and hint is None:
            return dist.all_gather(out, t, group=group, async_op=async_op)
        ranks = self.ranks(group)
        nbytes = t.numel() * t.element_size() * len(ranks)  # the output, as the table counts it
        backend = self.choose("all_gather", nbytes, ranks, hint)
        shadow = self._shadow(backend, ranks)
        after = None
        if shadow is None:
            def issue() -> list[Any]:
                return [dist.all_gather(out, t, group=group, async_op=True)]
        else:
            src, _ = _staged(shadow, t)
            bufs = [o if not needs_staging(shadow, o) else o.cpu() for o in out]

            def copy_back() -> None:
                for o, b in zip(out, bufs, strict=True):
                    if b is not o:
                        o.copy_(b)
            after = copy_back

            def issue() -> list[Any]:
                return [shadow.backend.allgather([bufs], [src])]
        return self._run("all_gather", "all_gather", nbytes, ranks, ranks, backend, axis, purpose, async_op, issue,
                         after, None)

    def reduce_scatter(self, out: torch.Tensor, inputs: list[torch.Tensor], group: dist.ProcessGroup | None = None,
                       *, async_op: bool = False, axis: str = "none", purpose: str = "",
                       hint: str | None = None) -> Any:
        if not self.active and hint is None:
            return dist.reduce_scatter(out, inputs, group=group, async_op=async_op)
        ranks = self.ranks(group)
        nbytes = sum(i.numel() * i.element_size() for i in inputs)
        backend = self.choose("reduce_scatter", nbytes, ranks, hint)
        shadow = self._shadow(backend, ranks)
        after = None
        if shadow is None:
            def issue() -> list[Any]:
                return [dist.reduce_scatter(out, inputs, group=group, async_op=True)]
        else:
            buf, after = _staged(shadow, out)
            ins = [i.cpu() if needs_staging(shadow, i) else i for i in inputs]

            def issue() -> list[Any]:
                return [shadow.backend.reduce_scatter([buf], [ins])]
        return self._run("reduce_scatter", "reduce_scatter", nbytes, ranks, ranks, backend, axis, purpose, async_op,
                         issue, after, None)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                   async_op: bool = False, axis: str = "none", purpose: str = "", hint: str | None = None) -> Any:
        """Equal splits (``all_to_all_single``): every rank's buffer has the same size, so every rank chooses alike."""
        if not self.active and hint is None:
            return dist.all_to_all_single(out, t, group=group, async_op=async_op)
        ranks = self.ranks(group)
        nbytes = t.numel() * t.element_size()
        backend = self.choose("all_to_all", nbytes, ranks, hint)
        shadow = self._shadow(backend, ranks)
        after = None
        if shadow is None:
            def issue() -> list[Any]:
                return [dist.all_to_all_single(out, t, group=group, async_op=True)]
        else:
            buf, after = _staged(shadow, out)
            src, _ = _staged(shadow, t)

            def issue() -> list[Any]:
                return [shadow.backend.alltoall_base(buf, src, [], [], dist.AllToAllOptions())]
        return self._run("all_to_all", "all_to_all", nbytes, ranks, ranks, backend, axis, purpose, async_op, issue,
                         after, None)

    def broadcast(self, t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, *,
                  async_op: bool = False, axis: str = "none", purpose: str = "", hint: str | None = None) -> Any:
        """``src`` is a global rank, as in ``torch.distributed.broadcast``."""
        if not self.active and hint is None:
            return dist.broadcast(t, src, group=group, async_op=async_op)
        ranks = self.ranks(group)
        nbytes = t.numel() * t.element_size()
        backend = self.choose("broadcast", nbytes, ranks, hint)
        shadow = self._shadow(backend, ranks)
        after = None
        if shadow is None:
            def issue() -> list[Any]:
                return [dist.broadcast(t, src, group=group, async_op=True)]
        else:
            buf, after = _staged(shadow, t)

            def issue() -> list[Any]:
                opts = dist.BroadcastOptions()
                opts.rootRank = shadow.group_rank(src)
                return [shadow.backend.broadcast([buf], opts)]
        return self._run("broadcast", "broadcast", nbytes, ranks, ranks, backend, axis, purpose, async_op, issue,
                         after, None)

    # ----- object collectives and barriers: always the run's own group --------------------------
    def all_gather_object(self, out: list[Any], obj: Any, group: dist.ProcessGroup | None = None, *,
                          axis: str = "none", purpose: str = "") -> None:
        if not self.active:
            dist.all_gather_object(out, obj, group=group)
            return
        ranks = self.ranks(group)
        nbytes = len(pickle.dumps(obj)) if self.logging else 0

        def issue() -> list[Any]:
            dist.all_gather_object(out, obj, group=group)
            return []
        self._run("all_gather_object", "all_gather", nbytes, ranks, ranks, self.default_backend, axis, purpose, False,
                  issue, None, None)

    def broadcast_object_list(self, objs: list[Any], src: int, group: dist.ProcessGroup | None = None, *,
                              axis: str = "none", purpose: str = "") -> None:
        if not self.active:
            dist.broadcast_object_list(objs, src=src, group=group)
            return
        ranks = self.ranks(group)
        nbytes = len(pickle.dumps(objs)) if self.logging else 0

        def issue() -> list[Any]:
            dist.broadcast_object_list(objs, src=src, group=group)
            return []
        self._run("broadcast_object_list", "broadcast", nbytes, ranks, ranks, self.default_backend, axis, purpose,
                  False, issue, None, None)

    def barrier(self, group: dist.ProcessGroup | None = None, *, purpose: str = "") -> None:
        if not self.active:
            dist.barrier(group=group)
            return
        ranks = self.ranks(group)

        def issue() -> list[Any]:
            dist.barrier(group=group)
            return []
        self._run("barrier", "barrier", 0, ranks, ranks, self.default_backend, "none", purpose, False, issue, None,
                  None)

    # ----- point-to-point ------------------------------------------------------------------------
    def batch_isend_irecv(self, ops: Sequence[P2P], group: dist.ProcessGroup | None = None, *,
                          axis: str = "pp", purpose: str = "", hint: str | None = None) -> list[Any]:
        """Every transfer of ``ops`` started together (torch's ``batch_isend_irecv`` for those on
        the run's own group); one handle per transfer, in order. Each transfer is one log row."""
        if not ops:
            return []
        if not self.active and hint is None:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend if o.send else dist.irecv, o.tensor, o.peer, group)
                                            for o in ops])
            return list(works)
        ranks = self.ranks(group)
        me = dist.get_rank()
        start = time.perf_counter()
        plans = []
        for o in ops:
            nbytes = o.tensor.numel() * o.tensor.element_size()
            backend = self.choose("send" if o.send else "recv", nbytes, ranks, hint)
            pair = (me, o.peer) if o.send else (o.peer, me)
            self._order(backend, ranks)
            plans.append((o, nbytes, backend, pair))
        own = [(i, p) for i, p in enumerate(plans) if p[2] == self.default_backend]
        handles: list[Any] = [None] * len(ops)
        if own:
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend if p[0].send else dist.irecv, p[0].tensor,
                                                       p[0].peer, group) for _, p in own])
            for (i, _), w in zip(own, works, strict=True):
                handles[i] = w
        for i, (o, _, backend, _) in enumerate(plans):
            if handles[i] is None:
                handles[i] = self._shadow_p2p(o, backend, ranks)
        out = []
        for (o, nbytes, backend, pair), w in zip(plans, handles, strict=True):
            after = w[1] if isinstance(w, tuple) else None
            work = w[0] if isinstance(w, tuple) else w
            meta = ("p2p", "send" if o.send else "recv", nbytes, pair, backend, axis, o.purpose or purpose, True)
            h = CallHandle(self, [work], meta, start, after, None, ranks)
            self._in_flight.setdefault(ranks, []).append((backend, h))
            out.append(h)
        return out

    def irecv(self, buf: torch.Tensor, peer: int, group: dist.ProcessGroup | None = None, *,
              axis: str = "pp", purpose: str = "", hint: str | None = None) -> Any:
        """One receive from global rank ``peer`` posted now (a prefetched pipeline receive): torch's
        ``irecv`` on the run's own group, as before the layer existed."""
        if not self.active and hint is None:
            return dist.irecv(buf, peer, group=group)
        ranks = self.ranks(group)
        nbytes = buf.numel() * buf.element_size()
        backend = self.choose("recv", nbytes, ranks, hint)
        if backend != self.default_backend:
            return self.batch_isend_irecv([P2P(False, buf, peer)], group, axis=axis, purpose=purpose, hint=hint)[0]
        self._order(backend, ranks)
        start = time.perf_counter()
        work = dist.irecv(buf, peer, group=group)
        meta = ("p2p", "recv", nbytes, (peer, dist.get_rank()), backend, axis, purpose, True)
        handle = CallHandle(self, [work], meta, start, None, None, ranks)
        self._in_flight.setdefault(ranks, []).append((backend, handle))
        return handle

    def _shadow_p2p(self, o: P2P, backend: str, ranks: tuple[int, ...]) -> tuple[Any, Callable[[], None] | None]:
        shadow = self._shadow(backend, ranks)
        assert shadow is not None
        buf, after = _staged(shadow, o.tensor)
        peer = shadow.group_rank(o.peer)
        if o.send:
            return shadow.backend.send([buf], peer, 0), None
        return shadow.backend.recv([buf], peer, 0), after

    # ----- the log -------------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for every call still in flight (the end of a run: their rows get logged)."""
        for pending in list(self._in_flight.values()):
            for _, h in list(pending):
                h.wait()

    def take_rows(self) -> list[CommCall]:
        rows, self.rows = self.rows, []
        return rows


def _is_device(name: str) -> bool:
    return torch_backend(name) == "nccl"


def _staged(shadow: Shadow, t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """The buffer the shadow works on and what to do once it completed (copy a staged result back)."""
    if not needs_staging(shadow, t):
        return t, None
    buf = t.to(shadow.device_type)

    def back() -> None:
        t.copy_(buf)
    return buf, back


# ----- the process's layer ----------------------------------------------------------------------------

_current = CommLayer(rank=0)


def current() -> CommLayer:
    """The layer calls go through (a plain pass-through until the step loop installs one)."""
    return _current


def use(layer: CommLayer | None) -> CommLayer:
    """Install ``layer`` (``None``: the pass-through) as the process's layer; returns the previous one."""
    global _current
    previous, _current = _current, layer if layer is not None else CommLayer(rank=0)
    return previous


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup | None = None, **kw: Any) -> Any:
    return _current.all_reduce(t, group, **kw)


def all_gather(out: list[torch.Tensor], t: torch.Tensor, group: dist.ProcessGroup | None = None, **kw: Any) -> Any:
    return _current.all_gather(out, t, group, **kw)


def reduce_scatter(out: torch.Tensor, inputs: list[torch.Tensor], group: dist.ProcessGroup | None = None,
                   **kw: Any) -> Any:
    return _current.reduce_scatter(out, inputs, group, **kw)


def all_to_all(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup | None = None, **kw: Any) -> Any:
    return _current.all_to_all(out, t, group, **kw)


def broadcast(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, **kw: Any) -> Any:
    return _current.broadcast(t, src, group, **kw)


def all_gather_object(out: list[Any], obj: Any, group: dist.ProcessGroup | None = None, **kw: Any) -> None:
    _current.all_gather_object(out, obj, group, **kw)


def broadcast_object_list(objs: list[Any], src: int, group: dist.ProcessGroup | None = None, **kw: Any) -> None:
    _current.broadcast_object_list(objs, src, group, **kw)


def barrier(group: dist.ProcessGroup | None = None, **kw: Any) -> None:
    _current.barrier(group, **kw)


def batch_isend_irecv(ops: Sequence[P2P], group: dist.ProcessGroup | None = None, **kw: Any) -> list[Any]:
    return _current.batch_isend_irecv(ops, group, **kw)


def irecv(buf: torch.Tensor, peer: int, group: dist.ProcessGroup | None = None, **kw: Any) -> Any:
    return _current.irecv(buf, peer, group, **kw)
