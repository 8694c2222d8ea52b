"""Worker for tests/runtime/test_ring_attention.py: ring attention against attention over the
whole sequence, in float64.

Every rank builds the same full ``q, k, v`` and output gradient from one seed, computes the
reference with ``scaled_dot_product_attention`` on the whole sequence, and then ring attention on
its own tokens (its zigzag chunks) over a ring of ``cp`` ranks; it writes the relative error of
the output and of the three input gradients, and the transfers it sent in the forward and the
backward (from the comm layer's log), per case, to ``OUT/rank<r>.json``.
One launch of 4 processes covers cp 4 (one ring) and cp 2 (two rings).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.runtime.comm import layer as comm
from paratrain.runtime.context_parallel import make_ring, ring_attention, zigzag_positions

CASES = [  # (name, heads, kv heads, causal)
    ("causal", 4, 4, True),
    ("causal-gqa", 4, 2, True),
    ("full", 2, 2, False),
]
B, SEQ, D = 2, 32, 8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm.use(comm.CommLayer(rank=rank, log=True, default_backend="gloo", device_type="cpu"))
    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}
    rings = {world: dist.group.WORLD}
    if world % 2 == 0 and world > 2:
        pairs = [list(range(i, i + 2)) for i in range(0, world, 2)]
        rings[2], _ = dist.new_subgroups_by_enumeration(pairs)
    for cp, group in sorted(rings.items()):
        for name, heads, kv_heads, causal in CASES:
            gen = torch.Generator().manual_seed(7)
            q = torch.randn(B, heads, SEQ, D, generator=gen, dtype=torch.float64)
            k = torch.randn(B, kv_heads, SEQ, D, generator=gen, dtype=torch.float64)
            v = torch.randn(B, kv_heads, SEQ, D, generator=gen, dtype=torch.float64)
            dy = torch.randn(B, heads, SEQ, D, generator=gen, dtype=torch.float64)
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            g = heads // kv_heads
            y = F.scaled_dot_product_attention(ref_in[0], ref_in[1].repeat_interleave(g, 1),
                                               ref_in[2].repeat_interleave(g, 1), is_causal=causal)
            y.backward(dy)
            ring = make_ring(group, causal)
            pos = zigzag_positions(SEQ, cp, ring.index)
            local = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
            comm.current().take_rows()
            y_local = ring_attention(*local, ring)
            forward = comm.current().take_rows()
            y_local.backward(dy[:, :, pos])
            backward = comm.current().take_rows()
            errs = {"out": rel(y_local.detach(), y.detach()[:, :, pos])}
            for label, rows in (("forward", forward), ("backward", backward)):
                # what this rank sent: transfers and bytes
                sends = [r for r in rows if r.op == "send" and r.axis == "cp"]
                errs[f"{label}_sends"] = float(len(sends))
                errs[f"{label}_send_bytes"] = float(sum(r.bytes for r in sends))
                errs[f"{label}_recvs"] = float(sum(1 for r in rows if r.op == "recv"))
            for label, mine, ref in zip("qkv", local, ref_in, strict=True):
                errs["d" + label] = rel(mine.grad, ref.grad[:, :, pos])
            results[f"cp{cp}-{name}"] = errs
            if name == "causal-gqa":  # bf16: against the fp64 reference, beside SDPA's own bf16 error
                b16 = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
                y16 = F.scaled_dot_product_attention(b16[0], b16[1].repeat_interleave(g, 1),
                                                     b16[2].repeat_interleave(g, 1), is_causal=causal)
                y16.backward(dy.to(torch.bfloat16))
                l16 = [t[:, :, pos].to(torch.bfloat16).clone().requires_grad_() for t in (q, k, v)]
                r16 = ring_attention(*l16, ring)
                r16.backward(dy[:, :, pos].to(torch.bfloat16))
                errs16 = {"out": rel(r16.detach().double(), y.detach()[:, :, pos]),
                          "sdpa_out": rel(y16.detach().double()[:, :, pos], y.detach()[:, :, pos])}
                for label, mine, full, ref in zip("qkv", l16, b16, ref_in, strict=True):
                    errs16["d" + label] = rel(mine.grad.double(), ref.grad[:, :, pos])
                    errs16["sdpa_d" + label] = rel(full.grad.double()[:, :, pos], ref.grad[:, :, pos])
                results[f"cp{cp}-{name}-bf16"] = errs16
    with open(f"{out}/rank{rank}.json", "w", encoding="utf-8") as fh:
        json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
