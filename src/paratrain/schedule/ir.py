"""The schedule IR: per pipeline rank, an ordered list of actions, plus the placement of model chunks.

One :class:`Schedule` object is consumed unchanged by the validator (``schedule.validate``), the
simulator (``paratrain.sim``), the trace exporter and the runtime pipeline engine. Everything an
executor needs is explicit; it never derives communication from the schedule's name.

Vocabulary
----------
* **chunk** ``c`` — a contiguous slice of layers, numbered in pipeline order ``0 .. num_chunks-1``
  (``num_chunks = stages × virtual_stages``). Chunk ``c`` feeds chunk ``c+1``.
* **replica** — a full copy of the pipeline. Every schedule has replica 0; Chimera (Li & Hoefler,
  SC'21) adds replica 1, the "up" pipeline that runs the chunks in reverse rank order. Each
  micro-batch belongs to exactly one replica.
* **placement** — ``placement[replica][chunk]`` is the pipeline rank that holds that chunk's
  weights: ``c`` (plain), ``c % stages`` (interleaved/looped), ``stages-1-c`` (Chimera's replica 1).
* **micro-batch** ``m`` — numbered globally: asynchronous schedules that cover several optimizer
  steps (PipeDream, 2BW) number the micro-batches of batch ``k`` as ``k·M … k·M+M-1``.

Actions (``kind`` letter in the text form)
------------------------------------------
* ``F`` forward, ``B`` full backward, ``I`` backward for the input only (dL/dx), ``W`` backward
  for the weights only (dL/dW) — of micro-batch ``m`` on chunk ``c`` of ``replica``. ``I`` + ``W``
  together replace one ``B`` (zero-bubble schedules, Qi et al., ICLR'24).
* ``SF``/``RF`` send / receive an activation; ``SB``/``RB`` send / receive an activation gradient.
  ``chunk`` is always the **local** chunk: ``SF`` carries the output of chunk ``c`` to the rank
  holding ``c+1`` and matches the ``RF`` of chunk ``c+1`` there; ``SB`` carries the input gradient
  of chunk ``c`` to the rank holding ``c-1`` and matches the ``RB`` of chunk ``c-1`` there.
  ``peer`` is the other pipeline rank.
* ``R`` reduce the gradients of chunk ``c`` (of ``replica``) over every rank holding a copy of it:
  the data-parallel group, plus, for Chimera, the rank holding the other replica.
* ``U`` optimizer step of every chunk on the rank: applies the gradients accumulated since the
  previous ``U`` (reduced by the ``R`` actions in between) to the newest weights; afterwards the
  rank's weight version is one higher. PipeDream steps after every backward, 2BW and the
  synchronous schedules after the last backward of a batch.
* ``X`` filler work named by ``tag`` (e.g. a K-FAC factor update placed in a bubble), with
  ``duration_s`` for the simulator. A filler whose tag's last dotted part is ``reduce`` (e.g.
  ``kfac.reduce``) is a **group collective** over the rank's filler group: the ranks holding a
  copy of any chunk the rank holds (the rank itself, plus the mirror rank under Chimera; the
  data-parallel copies run the same list and are not in the IR). The k-th collective filler of
  every member is one collective: it blocks until every member has reached it (as a p2p batch
  does) and then takes ``duration_s`` on all of them.

``version`` (forward/backward actions of asynchronous schedules) is the weight version the action
must use: the number of optimizer steps the rank had applied when that version was current. The
backward of a micro-batch uses the version of its forward (weight stashing, Narayanan et al.,
SOSP'19). ``None`` means "the current weights" (synchronous schedules).

Execution semantics (what the validator proves and the runtime may rely on)
---------------------------------------------------------------------------
1. A rank executes its list in order. A maximal run of consecutive ``SF/RF/SB/RB`` actions is
   **one p2p batch**: the runtime posts all its operations together (``batch_isend_irecv``) and
   waits for all of them before the next action. Every other action is a step of its own.
2. Matching is FIFO per ordered rank pair: the k-th send from rank a to rank b matches the k-th
   receive on b from a (what NCCL and gloo do without tags). The validator checks that the two
   sides agree on kind, micro-batch, chunk and replica for every k.
3. A p2p operation completes once its partner has been posted. A batch completes when all its
   operations have. A schedule is deadlock-free if every rank reaches its end under this rule
   (sends block as hard as receives, so it is also deadlock-free with eager sends).
4. ``R`` is non-blocking: it launches the reduction; the rank's next ``U`` waits for every
   reduction the rank launched. Ranks sharing a reduction group launch their ``R`` actions on it
   in the same order.
5. An ``F`` of chunk ``c > 0`` takes its input from the preceding ``RF`` of the same micro-batch,
   or, when chunk ``c-1`` is on the same rank, straight from that forward in memory (no message).
   Likewise for ``B``/``I`` and the gradient from chunk ``c+1``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from paratrain.errors import ConfigError

if TYPE_CHECKING:
    from paratrain.schedule.compiled import Compiled

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "COMPUTE_KINDS",
    "P2P_KINDS",
    "BACKWARD_KINDS",
    "parse_action",
    "insert_p2p",
]


class ActionKind(str, Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACT = "SF"
    RECV_ACT = "RF"
    SEND_GRAD = "SB"
    RECV_GRAD = "RB"
    REDUCE_GRAD = "R"
    OPTIMIZER_STEP = "U"
    FILLER = "X"

    def __str__(self) -> str:
        return self.value


K = ActionKind
COMPUTE_KINDS = frozenset({K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT})
BACKWARD_KINDS = frozenset({K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT})
P2P_KINDS = frozenset({K.SEND_ACT, K.RECV_ACT, K.SEND_GRAD, K.RECV_GRAD})
_SENDS = frozenset({K.SEND_ACT, K.SEND_GRAD})


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one pipeline rank. See the module docstring for the meaning of each field."""

    kind: ActionKind
    microbatch: int | None = None
    chunk: int | None = None
    replica: int = 0
    peer: int | None = None  # the other pipeline rank of a send/receive
    version: int | None = None  # weight version (asynchronous schedules)
    tag: str | None = None  # filler work's name
    duration_s: float | None = None  # filler work's duration for the simulator

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_p2p(self) -> bool:
        return self.kind in P2P_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in _SENDS

    @property
    def is_collective_filler(self) -> bool:
        """A filler that is a collective over the rank's filler group (see the module docstring)."""
        return self.kind is ActionKind.FILLER and (self.tag or "").rsplit(".", 1)[-1] == "reduce"

    def __str__(self) -> str:
        k = self.kind
        if k is K.OPTIMIZER_STEP:
            return "U"
        if k is K.FILLER:
            d = f"/{self.duration_s:g}" if self.duration_s is not None else ""
            return f"X:{self.tag or ''}{d}"
        s = k.value
        if self.microbatch is not None:
            s += str(self.microbatch)
        s += f"@c{self.chunk}"
        if self.replica:
            s += f"r{self.replica}"
        if self.version is not None:
            s += f"v{self.version}"
        if self.peer is not None:
            s += (">" if self.is_send else "<") + str(self.peer)
        return s


_ACTION_RE = re.compile(
    r"^(?P<kind>SF|RF|SB|RB|F|B|I|W|R)(?P<mb>\d+)?@c(?P<chunk>\d+)(?:r(?P<rep>\d+))?(?:v(?P<ver>\d+))?"
    r"(?:(?P<dir>[<>])(?P<peer>\d+))?$"
)


def parse_action(text: str, where: str = "action") -> Action:
    """Parse the text form written by ``str(action)``: ``F3@c1``, ``B3@c1r1v2``, ``SF3@c1>2``,
    ``RB3@c0<1``, ``R@c1``, ``U``, ``X:kfac/0.5``."""
    t = text.strip()
    if t == "U":
        return Action(K.OPTIMIZER_STEP)
    if t.startswith("X:"):
        body = t[2:]
        tag, _, dur = body.partition("/")
        try:
            d = float(dur) if dur else None
        except ValueError:
            raise ConfigError(where, f"filler duration {dur!r} is not a number", "write X:name/seconds") from None
        if d is not None and not 0 <= d < math.inf:  # NaN fails both comparisons
            raise ConfigError(where, f"filler duration {dur!r} is not a finite number ≥ 0", "write X:name/seconds")
        return Action(K.FILLER, tag=tag or None, duration_s=d)
    m = _ACTION_RE.match(t)
    if m is None:
        raise ConfigError(
            where,
            f"cannot parse action {text!r}",
            "write e.g. F3@c1, B3@c1, I3@c1, W3@c1, SF3@c1>2, RF3@c2<1, R@c1, U, X:name/0.5"
            " (r1 = replica 1, v2 = version 2)",
        )
    kind = ActionKind(m["kind"])
    mb = int(m["mb"]) if m["mb"] is not None else None
    if kind is K.REDUCE_GRAD and mb is not None:
        raise ConfigError(where, f"{text!r}: a gradient reduction has no micro-batch", "write R@c<chunk>")
    if kind is not K.REDUCE_GRAD and mb is None:
        raise ConfigError(where, f"{text!r} needs a micro-batch number", f"write e.g. {kind.value}0@c{m['chunk']}")
    is_p2p = kind in P2P_KINDS
    if is_p2p and m["peer"] is None:
        raise ConfigError(
            where, f"{text!r}: a send/receive needs its peer rank", "append >peer for sends, <peer for receives"
        )
    if m["peer"] is not None:
        if not is_p2p:
            raise ConfigError(where, f"{text!r}: only sends/receives have a peer", f"drop {m['dir']}{m['peer']}")
        if (m["dir"] == ">") != (kind in _SENDS):
            raise ConfigError(where, f"{text!r}: sends use '>peer', receives '<peer'", "fix the arrow")
    return Action(
        kind,
        mb,
        int(m["chunk"]),
        int(m["rep"] or 0),
        int(m["peer"]) if m["peer"] is not None else None,
        int(m["ver"]) if m["ver"] is not None else None,
    )


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``actions[rank]`` is the ordered action list of pipeline rank ``rank``.

    ``microbatches`` is the number of micro-batches per optimizer step (per pipeline, per
    data-parallel replica); ``iterations`` the optimizer steps the lists cover (1 for synchronous
    schedules; asynchronous ones are generated over several steps so that their steady state, which
    has no flush, is visible). ``weight_versions`` is the most weight versions any rank holds at
    once (1 for synchronous schedules).
    """

    name: str
    stages: int
    microbatches: int
    placement: tuple[tuple[int, ...], ...]
    actions: tuple[tuple[Action, ...], ...]
    iterations: int = 1
    weight_versions: int = 1

    @property
    def num_chunks(self) -> int:
        return len(self.placement[0])

    @property
    def num_replicas(self) -> int:
        return len(self.placement)

    @property
    def virtual_stages(self) -> int:
        return self.num_chunks // self.stages

    def rank_of(self, chunk: int, replica: int = 0) -> int:
        return self.placement[replica][chunk]

    def chunks_of(self, rank: int) -> list[tuple[int, int]]:
        """``(chunk, replica)`` pairs held by ``rank``, in pipeline order."""
        return [(c, rep) for rep, row in enumerate(self.placement) for c, r in enumerate(row) if r == rank]

    def filler_group(self, rank: int) -> tuple[int, ...]:
        """The ranks a collective filler of ``rank`` runs over: every rank holding a copy of a
        chunk ``rank`` holds (itself; under Chimera also the mirror rank), ascending."""
        return tuple(sorted({row[c] for c, _ in self.chunks_of(rank) for row in self.placement} | {rank}))

    def count(self, kind: ActionKind) -> int:
        return sum(1 for row in self.actions for a in row if a.kind is kind)

    @functools.cached_property
    def compiled(self) -> Compiled:
        """The compiled form (:mod:`paratrain.schedule.compiled`), built on first use and kept with
        this object: the validator, the simulator and a planner's repeated simulations share it.
        Raises ConfigError if sends and receives or reductions do not match."""
        from paratrain.schedule.compiled import compile_schedule

        return compile_schedule(self)

    # ----- text and JSON forms -------------------------------------------------------------
    def to_text(self) -> str:
        """One line per rank: ``rank 0: F0@c0 SF0@c0>1 ...``."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, row)) for r, row in enumerate(self.actions))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "iterations": self.iterations,
            "weight_versions": self.weight_versions,
            "placement": [list(row) for row in self.placement],
            "actions": [[str(a) for a in row] for row in self.actions],
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any], field_name: str = "schedule") -> Schedule:
        """Build a schedule from its JSON form (what :meth:`to_dict` writes).

        ``placement`` defaults to chunk ``c`` on rank ``c``. With ``"insert_p2p": true`` the lists
        may hold only compute, reduction and optimizer actions; sends and receives are inserted
        next to the actions that produce and consume them (:func:`insert_p2p`).
        """
        if not isinstance(doc, dict):
            raise ConfigError(field_name, "must be a JSON object", "see the README, \"Writing a schedule by hand\"")
        known = {
            "name",
            "stages",
            "microbatches",
            "iterations",
            "weight_versions",
            "placement",
            "actions",
            "insert_p2p",
        }
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ConfigError(
                f"{field_name} key {unknown[0]!r}",
                "is not a schedule field",
                f"use keys among: {', '.join(sorted(known))}",
            )
        rows = doc.get("actions")
        if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
            raise ConfigError(
                f"{field_name}.actions",
                "must be a list with one list of action strings per rank",
                'e.g. [["F0@c0", ...], [...]]',
            )
        stages = _count(doc, "stages", len(rows), field_name)
        if stages != len(rows):
            raise ConfigError(
                f"{field_name}.stages", f"is {stages} but there are {len(rows)} action lists", "give one list per rank"
            )
        placement_doc = doc.get("placement", [list(range(stages))])
        if not isinstance(placement_doc, list) or not all(
            isinstance(row, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in row)
            for row in placement_doc
        ):
            raise ConfigError(f"{field_name}.placement", "must be a list of lists of ranks", "e.g. [[0, 1, 2, 3]]")
        placement = tuple(tuple(row) for row in placement_doc)
        actions = tuple(
            tuple(parse_action(str(t), f"{field_name} rank {r} action {i}") for i, t in enumerate(row))
            for r, row in enumerate(rows)
        )
        mbs = {a.microbatch for row in actions for a in row if a.microbatch is not None}
        iterations = _count(doc, "iterations", 1, field_name)
        micro = _count(doc, "microbatches", max(1, (max(mbs) + 1) // iterations) if mbs else 1, field_name)
        if not isinstance(doc.get("insert_p2p", False), bool):
            raise ConfigError(f"{field_name}.insert_p2p", f"must be true or false, got {doc['insert_p2p']!r}",
                              "write true or false")
        if doc.get("insert_p2p"):
            actions = insert_p2p(actions, placement)
        sched = cls(
            name=str(doc.get("name", "custom")),
            stages=stages,
            microbatches=micro,
            placement=placement,
            actions=actions,
            iterations=iterations,
            weight_versions=_count(doc, "weight_versions", 1, field_name),
        )
        if "weight_versions" not in doc and any(a.version is not None for row in actions for a in row):
            # count them from the version annotations (raises, naming rank and action, if they are wrong)
            import dataclasses

            from paratrain.schedule.validate import inflight_and_versions

            sched = dataclasses.replace(sched, weight_versions=max(inflight_and_versions(sched)[1]))
        return sched


def _count(doc: dict[str, Any], key: str, default: int, field_name: str) -> int:
    """``doc[key]`` (or ``default``) as a count ≥ 1; a string, float, bool or null is an error,
    not something ``int()`` quietly rounds."""
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{field_name}.{key}", f"must be a whole number, got {v!r}", f"write {key} as an integer")
    if v < 1:
        raise ConfigError(f"{field_name}.{key}", f"must be at least 1, got {v}", f"write {key} as a positive integer")
    return v


def insert_p2p(
    compute: Sequence[Sequence[Action | tuple[Action, ...]]], placement: tuple[tuple[int, ...], ...]
) -> tuple[tuple[Action, ...], ...]:
    """Add the sends and receives implied by the compute actions and the placement.

    Each rank's compute actions form groups that run back to back (an action on its own, or a
    tuple of actions). Before each group comes one p2p batch holding the sends of the previous
    group's results and the receives of this group's inputs; after the last group, a batch with
    its sends. With one action per group this is Megatron-LM's 1F1B pairing
    (``send_forward_recv_backward``); interleaved 1F1B groups each steady-state (forward, backward)
    pair, as Megatron-LM's ``send_forward_backward_recv_forward_backward`` does, because with
    chunks looping from the last rank back to the first a send per action would close a cycle of
    blocking sends. Inside a batch, activations come before gradients, sends before receives, so
    that two ranks exchanging both in one batch list them in the same FIFO order.
    """
    last = len(placement[0]) - 1
    out = []
    for r, row in enumerate(compute):
        new: list[Action] = []
        sends: list[Action] = []
        for item in row:
            group = item if isinstance(item, tuple) else (item,)
            if not any(a.kind in COMPUTE_KINDS for a in group):
                if sends and any(a.kind is not K.REDUCE_GRAD for a in group):
                    # an optimizer step or filler work should not hold back the neighbours
                    _put_sends(new, sends)
                    sends = []
                new.extend(group)
                continue
            recvs: list[Action] = []
            group_sends: list[Action] = []
            for a in group:
                k, c, rep, m = a.kind, a.chunk, a.replica, a.microbatch
                if k is K.FORWARD:
                    if c > 0 and (q := placement[rep][c - 1]) != r:
                        recvs.append(Action(K.RECV_ACT, m, c, rep, q))
                    if c < last and (q := placement[rep][c + 1]) != r:
                        group_sends.append(Action(K.SEND_ACT, m, c, rep, q))
                elif k is K.BACKWARD or k is K.BACKWARD_INPUT:
                    if c < last and (q := placement[rep][c + 1]) != r:
                        recvs.append(Action(K.RECV_GRAD, m, c, rep, q))
                    if c > 0 and (q := placement[rep][c - 1]) != r:
                        group_sends.append(Action(K.SEND_GRAD, m, c, rep, q))
            new.extend(sorted(sends, key=_batch_order) + sorted(recvs, key=_batch_order))
            new.extend(group)
            sends = group_sends
        if sends:
            _put_sends(new, sends)
        out.append(new)
    return _fifo_receives(out)


def _fifo_receives(rows: list[list[Action]]) -> tuple[tuple[Action, ...], ...]:
    """Make every rank receive from each peer in the order that peer sends (matching is FIFO).

    When a rank consumes messages from one peer in a different order than the peer produced them
    (Chimera with 8 stages: rank 1 sends both gradients and activations to rank 0), the receives
    of the earlier messages move up into the batch of the first later one. Receives only move
    earlier, so every input still arrives before its use.
    """
    order: dict[tuple[int, int], dict[tuple[ActionKind, int | None, int | None, int], int]] = {}
    for a_rank, row in enumerate(rows):
        for a in row:
            if a.kind in _SENDS:
                d = order.setdefault((a_rank, a.peer), {})
                rk, dc = (K.RECV_ACT, 1) if a.kind is K.SEND_ACT else (K.RECV_GRAD, -1)
                d[(rk, a.microbatch, a.chunk + dc, a.replica)] = len(d)
    out = []
    for b, row in enumerate(rows):
        expect: dict[int, int] = {}
        in_order = True
        for a in row:
            if a.kind is K.RECV_ACT or a.kind is K.RECV_GRAD:
                k = order[(a.peer, b)].get((a.kind, a.microbatch, a.chunk, a.replica), -1)
                if k != expect.get(a.peer, 0):
                    in_order = False
                    break
                expect[a.peer] = k + 1
        if in_order:
            out.append(tuple(row))
            continue
        by_index = {src: {i: key for key, i in d.items()} for (src, dst), d in order.items() if dst == b}
        nxt: dict[int, int] = {}
        done: set[tuple[ActionKind, int | None, int | None, int]] = set()
        new: list[Action] = []
        for a in row:
            if a.kind is not K.RECV_ACT and a.kind is not K.RECV_GRAD:
                new.append(a)
                continue
            key = (a.kind, a.microbatch, a.chunk, a.replica)
            if key in done:
                continue
            k = order[(a.peer, b)][key]
            for i in range(nxt.get(a.peer, 0), k + 1):
                kind, mb, c, rep = by_index[a.peer][i]
                new.append(Action(kind, mb, c, rep, a.peer))
                done.add(by_index[a.peer][i])
            nxt[a.peer] = k + 1
        out.append(tuple(new))
    return tuple(out)


def _put_sends(new: list[Action], sends: list[Action]) -> None:
    """Append a batch of sends right after the last compute group, ahead of the reductions that
    follow it (those are non-blocking and need not delay the neighbours)."""
    tail = len(new)
    while tail > 0 and new[tail - 1].kind is K.REDUCE_GRAD:
        tail -= 1
    new[tail:tail] = sorted(sends, key=_batch_order)


_ORDER = {K.SEND_ACT: 0, K.SEND_GRAD: 1, K.RECV_ACT: 2, K.RECV_GRAD: 3}


def _batch_order(a: Action) -> int:
    return _ORDER[a.kind]
