"""Two backends mixed in one process group never deadlock and compute what one backend computes.

One 4-process launch (tests/runtime/forkrun.py: torchrun's environment) runs this file as a worker
(the ``__main__`` part): every rank draws
the same random program from a shared seed — several hundred calls of every operation the layer
offers (all-reduce, all-gather, reduce-scatter, all-to-all, broadcast, ring transfers), on the
world group and on two pairs of ranks, synchronous or asynchronous, with sizes on both sides of the
tuning table's band edges, some with a backend hint, waits deferred and taken in a random order —
through a :class:`~paratrain.runtime.comm.layer.CommLayer` whose table sends small calls to a second gloo
process group (``gloo_1t``) and large ones to the run's own. Every result is checked against its
closed form (the values are small integers, so every sum is exact). A deadlock would show as the
launch's timeout; the process group's own timeout is short so a stuck call fails within it. With
4 GPUs the same program runs on NCCL with small calls on gloo (host-staged), the MCR-DL pairing.

The same launch trains nothing; the training runs with mixed backends are in test_comm_layer.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORLD = 4
CALLS = 300
EDGE = 2048  # bytes: below, the second gloo group; from here up, the run's own
SEED = 18


# the run's own backend, and the one small calls go to
PAIRS = {"gloo": ("gloo", "gloo_1t"), "nccl": ("nccl", "gloo")}


def _table_doc(default: str, other: str, edge: int = EDGE) -> dict:
    ops = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send_recv")
    choices = []
    for op in ops:
        for g in (2, 4):
            choices += [{"op": op, "group_size": g, "min_bytes": 0, "max_bytes": edge, "backend": other},
                        {"op": op, "group_size": g, "min_bytes": edge, "max_bytes": None, "backend": default}]
    return {"format": "paratrain-comm-table", "version": 1, "world_size": WORLD, "default_backend": default,
            "backends": [default, other], "measurements": [], "choices": choices}


def _needs(backend: str) -> None:
    import torch

    if backend == "nccl" and torch.cuda.device_count() < WORLD:
        pytest.skip(f"NCCL + gloo needs {WORLD} GPUs")


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_random_call_orders_on_two_backends_never_deadlock(tmp_path: Path, backend: str) -> None:
    _needs(backend)
    default, other = PAIRS[backend]
    table = tmp_path / "table.json"
    table.write_text(json.dumps(_table_doc(default, other)))
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    from tests.runtime import forkrun  # here: this file also runs as the workers' script

    cmd = forkrun.command(WORLD, __file__, str(table), str(out), backend)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, f"launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    report = json.loads(out.read_text())
    # every call ran and was checked on every rank, on both backends, sync and async alike
    assert report["calls"] == CALLS
    assert report["checked"] == WORLD
    by_backend = report["rows_by_backend"]
    assert set(by_backend) == {default, other} and min(by_backend.values()) > 50
    assert report["async_rows"] > 50 and report["sync_rows"] > 50
    assert report["hinted_backends"] == [other]
    assert set(report["ops"]) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                                  "send", "recv"}


# ----- the worker --------------------------------------------------------------------------------

def _worker(table_path: str, out_path: str, backend: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from paratrain.runtime.comm import layer as comm
    from paratrain.runtime.comm.table import load_table

    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    layer = comm.CommLayer(log=True, table=load_table(table_path), default_backend=backend, device_type=dev.type,
                           timeout_s=60)
    f64 = {"dtype": torch.float64, "device": dev}
    comm.use(layer)
    rng = random.Random(SEED)  # the same program on every rank
    mine = pairs[rank // 2]
    in_flight: list[tuple[object, object]] = []  # (handle, check)

    def settle_some() -> None:
        rng.shuffle(in_flight)  # waits in an order unrelated to the issue order
        for _ in range(rng.randint(0, len(in_flight))):
            handle, check = in_flight.pop()
            handle.wait()  # type: ignore[attr-defined]
            check()  # type: ignore[operator]

    for i in range(CALLS):
        op = rng.choice(["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ring"])
        on_world = rng.random() < 0.5
        group, members = (None, list(range(world))) if on_world else (mine, [rank - rank % 2, rank - rank % 2 + 1])
        n = len(members)
        me = members.index(rank)
        numel = rng.choice([1, 7, 64, 255, 256, 257, 600, 5000])  # float64: 8 B … 40 KB, around the edge
        is_async = rng.random() < 0.5 and op != "ring"
        base = float(i % 5)

        if op == "all_reduce":
            t = torch.full((numel,), base + rank, **f64)
            want = n * base + sum(members)
            hinted = rng.random() < 0.2  # the caller names the backend: the table is not asked
            h = comm.all_reduce(t, group, async_op=is_async, purpose="hinted" if hinted else "random",
                                hint=PAIRS[backend][1] if hinted else None)

            def check(t=t, want=want, i=i) -> None:
                assert torch.all(t == want), (i, "all_reduce")
        elif op == "all_gather":
            t = torch.full((numel,), base + rank, **f64)
            outs = [torch.empty_like(t) for _ in members]
            h = comm.all_gather(outs, t, group, async_op=is_async, purpose="random")

            def check(outs=outs, members=members, base=base, i=i) -> None:
                assert all(torch.all(o == base + r) for o, r in zip(outs, members, strict=True)), (i, "all_gather")
        elif op == "reduce_scatter":
            inputs = [torch.full((numel,), base + rank + 10 * j, **f64) for j in range(n)]
            out = torch.empty(numel, **f64)
            want = n * base + sum(members) + 10 * me * n
            h = comm.reduce_scatter(out, inputs, group, async_op=is_async, purpose="random")

            def check(out=out, want=want, i=i) -> None:
                assert torch.all(out == want), (i, "reduce_scatter")
        elif op == "all_to_all":
            src = torch.cat([torch.full((numel,), 100.0 * rank + j, **f64) for j in range(n)])
            out = torch.empty_like(src)
            h = comm.all_to_all(out, src, group, async_op=is_async, purpose="random")

            def check(out=out, members=members, me=me, numel=numel, i=i) -> None:
                want = torch.cat([torch.full((numel,), 100.0 * r + me, **f64) for r in members])
                assert torch.equal(out, want), (i, "all_to_all")
        elif op == "broadcast":
            root = rng.choice(members)
            t = torch.full((numel,), base + rank, **f64)
            h = comm.broadcast(t, root, group, async_op=is_async, purpose="random")

            def check(t=t, want=base + root, i=i) -> None:
                assert torch.all(t == want), (i, "broadcast")
        else:  # one step around the ring of the group's members
            nxt, prv = members[(me + 1) % n], members[(me - 1) % n]
            send = torch.full((numel,), base + rank, **f64)
            recv = torch.empty(numel, **f64)
            how = rng.random()
            if how < 1 / 3:  # the receive posted ahead, on its own (a pipeline's prefetched receive)
                hs = [comm.irecv(recv, prv, group, purpose="random"),
                      *comm.batch_isend_irecv([comm.P2P(True, send, nxt)], group, purpose="random")]
            else:  # one batch, the receive first or last: the pairing must not care
                ops = [comm.P2P(True, send, nxt), comm.P2P(False, recv, prv)]
                hs = comm.batch_isend_irecv(ops if how < 2 / 3 else ops[::-1], group, purpose="random")
            for w in hs:
                w.wait()
            assert torch.all(recv == base + prv), (i, "ring")
            h, check = None, None
        if h is not None:
            in_flight.append((h, check))
        elif check is not None:
            check()
        if rng.random() < 0.3:
            settle_some()
    for handle, check in in_flight:
        handle.wait()  # type: ignore[attr-defined]
        check()  # type: ignore[operator]
    layer.settle()
    rows = layer.take_rows()
    counts = torch.tensor([1], dtype=torch.int64, device=dev)
    dist.all_reduce(counts)  # every rank got here with all its checks passed
    if rank == 0:
        by_backend: dict[str, int] = {}
        for r in rows:
            by_backend[r.backend] = by_backend.get(r.backend, 0) + 1
        report = {"calls": CALLS, "checked": int(counts), "rows_by_backend": by_backend,
                  "async_rows": sum(r.async_op for r in rows), "sync_rows": sum(not r.async_op for r in rows),
                  "ops": sorted({r.op for r in rows}),
                  "hinted_backends": sorted({r.backend for r in rows if r.purpose == "hinted"})}
        Path(out_path).write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])
