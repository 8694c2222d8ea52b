"""CoorDL's partitioned cache (Mohan et al., VLDB'21, sec. 4.2): data-parallel training on several
nodes, each caching a shard of the dataset in memory, so the aggregate cache is the sum of the
nodes' memories; an item another node caches comes from that node instead of storage.

Processes stand in for nodes, torch.distributed (gloo) for the network. As in CoorDL, no node
asks: every node derives every node's cached set from the shared seed (a seeded permutation of
the items, position ``p`` owned by node ``p mod world`` while ``p < world * capacity_items``), and
every node knows every node's share of a step from the shared sampler. So each step is one
exchange: an owner sends each peer the items of its shard that the peer needs (from its cache,
or storage the first time, filling its cache), lengths first, then the bytes. Items no node
caches are read from storage by the node that needs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..comm import layer as comm

__all__ = ["PartitionedCache", "PartitionStats", "owners"]


def owners(items: int, world: int, capacity_items: int, seed: int) -> list[int | None]:
    """The node caching each item (``None``: no node does)."""
    order = torch.randperm(items, generator=torch.Generator().manual_seed(seed)).tolist()
    out: list[int | None] = [None] * items
    for p, i in enumerate(order[: world * capacity_items]):
        out[i] = p % world
    return out


@dataclass
class PartitionStats:
    local_hits: int = 0
    remote_hits: int = 0  # items this node received from the node caching them
    served: int = 0  # items this node sent to others
    storage_reads: int = 0


class PartitionedCache:
    """This node's part of the cache over ``dataset`` (a staged dataset: ``fetch``, ``prep``).

    ``capacity_items``: items each node caches. ``group``: the process group of the nodes (default: world).
    """

    def __init__(self, dataset: Any, *, capacity_items: int, seed: int = 0,
                 group: dist.ProcessGroup | None = None) -> None:
        self.dataset, self.group = dataset, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.owner = owners(len(dataset), self.world, capacity_items, seed)
        self.cache: dict[int, bytes] = {}
        self.stats = PartitionStats()

    def _own(self, index: int) -> bytes:
        """An item of this node's shard: from its cache, else storage (and then cached)."""
        blob = self.cache.get(index)
        if blob is None:
            blob = self.dataset.fetch(index)
            self.stats.storage_reads += 1
            self.cache[index] = blob
        return blob

    def _peer(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def fetch(self, needs: Sequence[Sequence[int]]) -> list[bytes]:
        """The bytes of ``needs[self.rank]``, in order. A collective: every node calls it with the
        same ``needs`` (every node's items of this step)."""
        mine = list(needs[self.rank])
        out: dict[int, bytes] = {}
        for i in mine:
            o = self.owner[i]
            if o == self.rank:
                hit = i in self.cache
                out[i] = self._own(i)
                self.stats.local_hits += int(hit)
            elif o is None:
                out[i] = self.dataset.fetch(i)
                self.stats.storage_reads += 1
        outgoing: dict[int, list[bytes]] = {}
        for r in range(self.world):
            if r == self.rank:
                continue
            asked = [i for i in needs[r] if self.owner[i] == self.rank]
            outgoing[r] = [self._own(i) for i in asked]
            self.stats.served += len(asked)
        incoming = {r: [i for i in mine if self.owner[i] == r] for r in range(self.world) if r != self.rank}
        # lengths first: the receiver knows how many items, not how many bytes
        lengths = {r: torch.empty(len(ids), dtype=torch.int64) for r, ids in incoming.items() if ids}
        ops = [comm.P2P(True, torch.tensor([len(b) for b in blobs], dtype=torch.int64), self._peer(r))
               for r, blobs in outgoing.items() if blobs]
        ops += [comm.P2P(False, t, self._peer(r)) for r, t in lengths.items()]
        for w in comm.batch_isend_irecv(ops, self.group, axis="dp", purpose="cache_lengths"):
            w.wait()
        payloads = {r: torch.empty(int(t.sum()), dtype=torch.uint8) for r, t in lengths.items()}
        ops = [comm.P2P(True, torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8), self._peer(r))
               for r, blobs in outgoing.items() if blobs]
        ops += [comm.P2P(False, t, self._peer(r)) for r, t in payloads.items()]
        for w in comm.batch_isend_irecv(ops, self.group, axis="dp", purpose="cache_items"):
            w.wait()
        for r, t in payloads.items():
            raw, start = t.numpy().tobytes(), 0
            for i, n in zip(incoming[r], lengths[r].tolist(), strict=True):
                out[i] = raw[start:start + n]
                start += n
            self.stats.remote_hits += len(incoming[r])
        return [out[i] for i in mine]

    def batch(self, needs: Sequence[Sequence[tuple[int, int]]]) -> list[Any]:
        """This node's prepared items of a step: ``needs[r]`` is node ``r``'s ``(epoch, index)`` keys."""
        raws = self.fetch([[i for _, i in keys] for keys in needs])
        return [self.dataset.prep(raw, key) for raw, key in zip(raws, needs[self.rank], strict=True)]
