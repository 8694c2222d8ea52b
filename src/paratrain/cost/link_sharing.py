"""Point-to-point transfers that run at once through one link share its bandwidth.

The interleaved pipeline schedule exchanges, in its steady state, a forward activation and a
backward gradient with both pipeline neighbours in one batched call: Megatron-LM's
``send_forward_backward_recv_forward_backward`` posts two sends and two receives together
(``torch.distributed.batch_isend_irecv``) and waits for all four (Narayanan et al. 2021, sec. 3.2
and 4.1: the interleaved schedule's extra communication; ``megatron/core/pipeline_parallel/
p2p_communication.py``). paratrain's interleaved generator batches the same four operations. A
stage therefore receives from its predecessor and its successor at the same time, and both
neighbours sit on other nodes when ``pp`` is an outer mesh axis; a DGX GPU reaches other nodes
through its own NIC (DGX A100: eight 200 Gb/s HDR ConnectX-6 compute ports, one per GPU, NVIDIA
DGX A100 User Guide, "Network Connections"), so the two receives divide its bandwidth, and the two
sends its bandwidth out. The simulator used to time every transfer of a batch as if it had the link
alone.

Transfers sharing a link fairly (max-min fair, as a single bottleneck link shares it between
flows), all starting together and taking ``x_1 … x_n`` alone, finish at

    c_i = Σ_j min(x_j, x_i)

(processor sharing: until the shortest ends all progress at rate 1/n; the closed form follows by
induction over the transfers in order of size). Equal transfers all take ``n·x``; one transfer is
unchanged. The latency part of ``x`` is shared too, which overstates a batch of tiny transfers by
at most ``(n−1)·α``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from paratrain.errors import ConfigError

__all__ = ["shared_completion_s", "share_by_link"]


def shared_completion_s(times_s: Sequence[float]) -> tuple[float, ...]:
    """Completion time of each transfer (alone: ``times_s[i]``) when all start together on one link."""
    for t in times_s:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):
            raise ConfigError("transfer time", f"must be a finite number >= 0, got {t!r}",
                              "give the transfer times in seconds")
    return tuple(sum(min(x, t) for x in times_s) for t in times_s)


def share_by_link(times_s: Sequence[float], links: Sequence[Hashable]) -> tuple[float, ...]:
    """:func:`shared_completion_s` within each group of transfers on the same link (``links[i]``
    names transfer ``i``'s link); transfers on different links do not slow each other."""
    if len(times_s) != len(links):
        raise ConfigError("links", f"{len(links)} links for {len(times_s)} transfers", "give one link per transfer")
    out = list(times_s)
    for link in set(links):
        idx = [i for i, k in enumerate(links) if k == link]
        if len(idx) > 1:
            for i, c in zip(idx, shared_completion_s([times_s[i] for i in idx]), strict=True):
                out[i] = c
    return tuple(out)
