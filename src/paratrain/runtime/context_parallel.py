"""Context parallelism: ring attention over the ``cp`` ranks that each hold part of every sequence.

What ``cost/context_parallel.py`` prices, run for real (Megatron-LM / Transformer Engine's
``AttnFuncWithCPAndKVP2P``; Liu et al. 2023, "Ring Attention with Blockwise Transformers"):

- the sequence is cut into ``2·cp`` chunks and cp rank ``i`` keeps chunks ``i`` and ``2·cp−1−i``
  (:func:`zigzag_positions`), so under a causal mask every rank does the same attention work;
  everything outside the attention core runs on those ``s/cp`` tokens at their true positions;
- attention takes ``cp`` block steps. At each, the rank attends its queries to the K/V block it
  holds while that block travels on to the next rank of the ring and the previous rank's arrives
  (the first ``cp−1`` steps). Blocks are combined by their log-sum-exp (the online softmax of
  FlashAttention), so the result equals attention over the whole sequence;
- per (query chunk, key chunk) pair of a step the causal mask is all-or-nothing except on the
  diagonal: a later key chunk is skipped, an earlier one is attended in full, the same chunk
  under the triangular mask. Each step therefore computes half of the ``(s/cp)²`` scores;
- the backward runs the ring again: K and V travel as in the forward, and one hop behind them the
  gradients ``dK, dV`` summed for each block so far, each hop overlapped with the next block's
  work; the owner keeps its own share, so after ``cp−1`` hops of each (the cost model's
  ``2·(cp−1)`` K/V-sized transfers) every block's gradients are home;
- parameters are replicated over cp; their gradients are reduced over the data- and
  context-parallel ranks together (:meth:`RuntimeContext.data_group`), each rank's loss being
  the mean over its own tokens.

Under grouped-query attention the ring carries the key/value heads only (the cost model's
``kv_block_bytes``); each block is expanded to the query heads where it is used. Matmuls run in
the inputs' dtype (bf16 under autocast); the block statistics, the output and the gradients are
accumulated in at least fp32, and dK, dV travel in it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.spec.model import ModelSpec

from .comm import layer as comm
from .data import Batch
from .models.base import IGNORE_INDEX, TransformerLM

__all__ = ["Ring", "zigzag_positions", "chunk_ids", "block_pairs", "ring_attention", "shard_batch", "make_ring",
           "counted_loss", "apply_context_parallel"]


def zigzag_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Positions of the tokens cp rank ``rank`` holds: chunks ``rank`` and ``2·cp−1−rank`` of
    ``2·cp`` equal chunks, in that order."""
    if seq % (2 * cp):
        raise ValueError(f"sequence {seq} is not divisible by 2*cp = {2 * cp}")
    c = seq // (2 * cp)
    a, b = chunk_ids(cp, rank)
    return torch.cat((torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)))


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2·cp``) that cp rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def shard_batch(batch: Batch, positions: torch.Tensor) -> Batch:
    """A data-parallel rank's batch cut to this cp rank's tokens (inputs and targets alike)."""
    return Batch(inputs=batch.inputs[..., positions], targets=batch.targets[..., positions])


@dataclass(frozen=True)
class Ring:
    """One rank's place in its context-parallel ring: ``ranks`` the group's global ranks in cp
    order, ``index`` this rank's place among them."""

    group: Any
    ranks: tuple[int, ...]
    index: int
    causal: bool = True

    def __call__(self, q_BNSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor) -> torch.Tensor:
        return ring_attention(q_BNSD, k_BKSD, v_BKSD, self)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.index - 1) % self.size]

    def owner_at(self, step: int) -> int:
        """Whose K/V block this rank holds at ring step ``step``."""
        return (self.index - step) % self.size

    def pass_on(self, send: list[torch.Tensor], purpose: str) -> _Transfer:
        """Start sending ``send`` to the next rank and receiving as many tensors of the same shapes
        from the previous one."""
        sent = [t.contiguous() for t in send]
        bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in sent]
        ops = [comm.P2P(True, t, self.next) for t in sent] + [comm.P2P(False, b, self.prev) for b in bufs]
        return _Transfer(bufs, sent, comm.batch_isend_irecv(ops, self.group, axis="cp", purpose=purpose))


@dataclass
class _Transfer:
    """One hop of the ring in flight; the sent tensors are kept alive until it completes."""

    bufs: list[torch.Tensor]
    sent: list[torch.Tensor]
    handles: list[Any]

    def wait(self) -> list[torch.Tensor]:
        for h in self.handles:
            h.wait()
        self.sent = []
        return self.bufs


def block_pairs(ring: Ring, owner: int) -> list[tuple[int, int, bool]]:
    """The (query chunk, key chunk, diagonal) pairs this rank computes against ``owner``'s block:
    local chunk indices 0/1 on both sides; without a causal mask every pair, in full."""
    mine, theirs = chunk_ids(ring.size, ring.index), chunk_ids(ring.size, owner)
    out = []
    for qi, qc in enumerate(mine):
        for ki, kc in enumerate(theirs):
            if not ring.causal or kc < qc:
                out.append((qi, ki, False))
            elif kc == qc:
                out.append((qi, ki, True))
    return out


def _expand(t_BKSD: torch.Tensor, groups: int) -> torch.Tensor:
    return t_BKSD if groups == 1 else t_BKSD.repeat_interleave(groups, dim=1)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if diagonal:  # same chunk: positions align, so the causal mask is the upper triangle
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:  # type: ignore[override]
        groups = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        dt, acc = q.dtype, _accumulation_dtype(q.dtype)
        qc = q.chunk(2, dim=2)
        c = qc[0].shape[2]
        shape = (*q.shape[:2], c)
        out = [torch.zeros(qc[0].shape, dtype=acc, device=q.device) for _ in range(2)]
        lse = [torch.full(shape, float("-inf"), dtype=acc, device=q.device) for _ in range(2)]
        kv = [k, v]
        for step in range(ring.size):
            pending = ring.pass_on(kv, "ring_kv") if step < ring.size - 1 else None
            kc, vc = (_expand(t, groups).chunk(2, dim=2) for t in kv)
            for qi, ki, diag in block_pairs(ring, ring.owner_at(step)):
                s = _scores(qc[qi], kc[ki], scale, diag).to(acc)
                part_lse = torch.logsumexp(s, dim=-1)
                part = torch.matmul(torch.exp(s - part_lse.unsqueeze(-1)).to(dt), vc[ki]).to(acc)
                new = torch.logaddexp(lse[qi], part_lse)
                out[qi] = (out[qi] * torch.exp(lse[qi] - new).unsqueeze(-1)
                           + part * torch.exp(part_lse - new).unsqueeze(-1))
                lse[qi] = new
            if pending is not None:
                kv = pending.wait()
        o = torch.cat(out, dim=2).to(dt)
        ctx.save_for_backward(q, k, v, o, torch.cat(lse, dim=2))
        ctx.ring, ctx.groups, ctx.scale = ring, groups, scale
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        ring, groups, scale = ctx.ring, ctx.groups, ctx.scale
        dt, acc = q.dtype, lse.dtype
        do = do.to(dt).contiguous()
        delta = (do.to(acc) * o.to(acc)).sum(-1)  # rowsum(dO ∘ O): the softmax backward's correction term
        qc, doc, lsec, deltac = (t.chunk(2, dim=2) for t in (q, do, lse, delta))
        dq = [torch.zeros(qc[0].shape, dtype=acc, device=q.device) for _ in range(2)]
        kv = [k, v]
        own: list[torch.Tensor] = []  # this rank's part of its own block's dK, dV (step 0)
        hop: _Transfer | None = None  # the last summed dK, dV: out to the next rank, in from the previous
        for step in range(ring.size):
            # K and V go ahead while this block is worked on; its gradients follow one step behind
            pending = ring.pass_on(kv, "ring_kv") if step < ring.size - 1 else None
            kc, vc = (_expand(t, groups).chunk(2, dim=2) for t in kv)
            dk = [torch.zeros(kc[0].shape, dtype=acc, device=q.device) for _ in range(2)]
            dv = [torch.zeros(vc[0].shape, dtype=acc, device=q.device) for _ in range(2)]
            for qi, ki, diag in block_pairs(ring, ring.owner_at(step)):
                p = torch.exp(_scores(qc[qi], kc[ki], scale, diag).to(acc) - lsec[qi].unsqueeze(-1))
                dv[ki] = dv[ki] + torch.matmul(p.to(dt).transpose(-2, -1), doc[qi])
                dp = torch.matmul(doc[qi], vc[ki].transpose(-2, -1)).to(acc)
                ds = (p * (dp - deltac[qi].unsqueeze(-1))).to(dt)
                dq[qi] = dq[qi] + torch.matmul(ds, kc[ki]) * scale
                dk[ki] = dk[ki] + torch.matmul(ds.transpose(-2, -1), qc[qi]) * scale
            mine = [_fold(torch.cat(g, dim=2), groups) for g in (dk, dv)]
            if step == 0:
                own = mine  # kept here: the block's sum comes home after the other cp-1 ranks
            else:
                # the previous hop brought the sum for the block held now (none yet at step 1)
                arriving = hop.wait() if hop is not None else None
                total = mine if arriving is None else [a + m for a, m in zip(arriving, mine, strict=True)]
                # to the next rank, which holds this block next step (home after the last); it
                # travels while the next block is worked on
                hop = ring.pass_on(total, "ring_dkv")
            if pending is not None:
                kv = pending.wait()
        assert hop is not None
        dkv = [mine0 + a for mine0, a in zip(own, hop.wait(), strict=True)]
        return torch.cat(dq, dim=2).to(dt), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics, outputs and gradients are summed over blocks in at least fp32 (bf16
    inputs: as FlashAttention accumulates; torch's ring attention's ``convert_to_f32``)."""
    return torch.promote_types(dtype, torch.float32)


def _fold(g_BNSD: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradients of the query heads sharing a key/value head (the expansion's backward)."""
    if groups == 1:
        return g_BNSD
    b, n, s, d = g_BNSD.shape
    return g_BNSD.view(b, n // groups, groups, s, d).sum(2)


def ring_attention(q_BNSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, ring: Ring) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, its K/V blocks passed round
    ``ring``. Inputs hold this rank's tokens in :func:`zigzag_positions` order; key/value heads
    (``K``) divide the query heads (``N``)."""
    if q_BNSD.shape[2] % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks, got {q_BNSD.shape[2]} tokens")
    return _RingAttention.apply(q_BNSD, k_BKSD, v_BKSD, ring)


def counted_loss(ring: Ring) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of a model whose targets may be ignored (BERT's masked LM: only the masked
    positions count, and their number differs between the cp ranks): this rank's summed token
    loss over the micro-batch's count of targets on every cp rank (one all-reduce of a count),
    times cp, so that the dp x cp average of the ranks' gradients is the micro-batch mean's. A
    causal LM counts every token, so its ranks' plain means already are that."""

    def loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
        count = (targets_BS != IGNORE_INDEX).sum().to(torch.float64)
        comm.all_reduce(count, ring.group, axis="cp", purpose="loss_count")
        return total * (ring.size / max(float(count), 1.0))

    return loss


def make_ring(group: dist.ProcessGroup, causal: bool) -> Ring:
    """This rank's ring over ``group`` (its cp ranks in cp order)."""
    ranks = tuple(dist.get_process_group_ranks(group))
    return Ring(group=group, ranks=ranks, index=ranks.index(dist.get_rank()), causal=causal)


def apply_context_parallel(modules: list[nn.Module], group: dist.ProcessGroup, spec: ModelSpec
                           ) -> tuple[torch.Tensor, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Make ``modules`` (a :class:`~paratrain.runtime.models.TransformerLM`, or this rank's pipeline
    chunks of one; tensor parallelism applied or not) run on this cp rank's tokens: learned and
    rotary positions of those tokens, every attention through the ring over ``group``. Returns the
    positions, to cut each batch with, and the loss to train with (:func:`counted_loss` unless
    every token counts)."""
    ring = make_ring(group, spec.is_causal)
    positions = zigzag_positions(spec.seq, ring.size, ring.index)
    for model in modules:
        model.positions = positions  # the rotary tables' rows
        if model.embed is not None:
            model.embed.positions = positions
        for block in model.blocks:
            block.attn.ring = ring
    return positions, TransformerLM.loss if spec.is_causal else counted_loss(ring)
