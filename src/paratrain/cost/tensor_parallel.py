"""Tensor parallelism as the runtime runs it: the collectives DTensor issues per micro-batch, their
time on the cluster, and the host time of DTensor's dispatch.

The runtime (``paratrain.runtime.tensor_parallel``) applies Megatron-LM's split (Shoeybi et al.
2019) through DTensor's ``ColwiseParallel`` / ``RowwiseParallel`` styles, one per ``nn.Linear``.
What DTensor then communicates differs from Megatron-LM's fused layers, and this module counts it
as DTensor issues it (checked against a recording of a gloo run in
tests/runtime/test_calibrate_tp.py). With ``T`` tokens per micro-batch, ``h`` the hidden size and
``A = T·h`` activation elements:

- forward, per layer: the two row-parallel projections (attention output, second MLP GEMM) reduce
  their partial sums: 2 all-reduces of ``A`` (Megatron's two), with sequence parallelism 2
  reduce-scatters into the sequence-split residual stream plus 2 all-gathers of ``A`` where the
  attention and MLP inputs are gathered back (``PrepareModuleInput``);
- backward, per layer: the column-parallel linears of each half-block (Q, K, V; the first MLP
  GEMM and the SwiGLU gate) share one ``Replicate`` DTensor input (``PrepareModuleInput`` on
  attention and MLP), so autograd sums their partial input gradients before the input's conversion
  reduces them: 2 all-reduces of ``A``, Megatron-LM's two (fused QKV). With sequence parallelism
  that reduction is a reduce-scatter into the sequence shards (2 of ``A``), the row-parallel
  reduce-scatters' backward adds 2 all-gathers of ``A``, and the norms' replicated weights (and
  biases), applied to sequence shards, all-reduce their partial gradients: one all-reduce of ``h``
  per norm parameter tensor, issued once for the ``accumulated`` micro-batches whose gradients the
  runtime sums before it reduces them (``runtime.tensor_parallel.accumulating_partial_grads``: a
  step's micro-batches, or one under the asynchronous pipeline schedules, which step after every
  micro-batch);
- the vocabulary-parallel embedding all-reduces its output (``A``; its backward, on token ids,
  needs none; with sequence parallelism its sequence slice's backward all-gathers ``A``);
- the head's column-parallel output projection all-reduces its input gradient (``A``; with
  sequence parallelism its input is first all-gathered, ``A``), and ``loss_parallel``'s
  cross-entropy all-reduces three fp32 values per token in the forward (the row maximum, the sum
  of exponentials, the target's logit).

Times: a collective's time is read from the cluster's ``measured_collectives`` (what ``paratrain
calibrate`` measured per collective inside a block parallelized with the runtime's plan, beyond
the block's own work and dispatch: ``runtime.calibrate_tp``) by a least-squares line in bytes,
where it holds that kind and group size; else the alpha-beta model
(:func:`paratrain.cost.collectives.collective_time`). DTensor's host time is
``tp_dispatch_forward_s`` / ``tp_dispatch_backward_s`` of the device per parallelized module.

On a CPU host a collective is partly work and partly waiting. The cluster's ``collective_cpu_s``
holds the CPU ``c`` one collective costs each process of its group (gloo's threads included; the
same least-squares line in bytes); the calibration timed one group alone, where its ``g`` processes compute at rate
``r = min(1, cores / (g · threads))`` (:func:`group_rate`), so the measured time ``a`` is
``c / r`` of work plus ``l = a − c / r`` of waiting. The model keeps the two apart: at full speed
the collective takes ``c + l``, ``c`` of it host work (beside the dispatch), which the simulator
shares among the processes computing on the node, ``l`` a wait that takes no core.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.cost.collectives import collective_time
from paratrain.cost.compute import dtype_bytes
from paratrain.spec.cluster import ClusterSpec
from paratrain.spec.model import ModelSpec

__all__ = ["TPCollective", "TPPart", "collective_cpu", "collective_s", "fit_line", "group_rate", "tp_parts",
           "tp_part_cpu", "tp_part_times", "measured_time"]

LOSS_VALUES_PER_TOKEN = 3  # loss_parallel: row maximum, sum of exponentials, target logit (fp32)


@dataclass(frozen=True)
class TPCollective:
    """``count`` collectives of ``kind`` over the tensor-parallel group, ``nbytes`` per rank each
    (the input of an all-reduce or reduce-scatter, the output of an all-gather). A fraction is a
    collective issued once for several micro-batches, charged as its share of each."""

    kind: str
    nbytes: int
    count: float


@dataclass(frozen=True)
class TPPart:
    """What one piece (a layer, the embedding or the head with the loss) issues per micro-batch:
    its collectives and its tensor-parallel modules (each a DTensor dispatch), forward and backward."""

    forward: tuple[TPCollective, ...]
    backward: tuple[TPCollective, ...]
    modules: int


def _norm_param_tensors(model: ModelSpec) -> int:
    """Parameter tensors of one norm: RMSNorm a weight, LayerNorm a weight and a bias."""
    return 1 if model.norm_params() == model.hidden else 2


def _megatron_parts(act: int, loss: TPCollective, sequence_parallel: bool) -> dict[str, TPPart]:
    """Megatron-LM's fused layers (Shoeybi et al. 2019, fig. 3): each layer all-reduces its output
    twice in the forward and its input gradient twice in the backward (fused QKV: one gradient for
    the three). With sequence parallelism each all-reduce becomes an all-gather + reduce-scatter
    pair of the same buffer (Korthikanti et al. 2022, sec. 4.2.2); the backward's re-gather of the
    inputs for the weight gradients overlaps with the input-gradient GEMMs and is not counted. The
    embedding all-reduces (reduce-scatters) its output, the head all-reduces (with SP all-gathers
    its input and reduce-scatters) its input gradient. Fused kernels: no host dispatch counted."""
    if sequence_parallel:
        pair = (TPCollective("all_gather", act, 2), TPCollective("reduce_scatter", act, 2))
        gather, scatter = TPCollective("all_gather", act, 1), TPCollective("reduce_scatter", act, 1)
        return {"layer": TPPart(pair, pair, 0), "embedding": TPPart((scatter,), (gather,), 0),
                "head": TPPart((gather, loss), (scatter,), 0)}
    ar = TPCollective("all_reduce", act, 1)
    return {"layer": TPPart((TPCollective("all_reduce", act, 2),), (TPCollective("all_reduce", act, 2),), 0),
            "embedding": TPPart((ar,), (), 0), "head": TPPart((loss,), (ar,), 0)}


def tp_parts(
    model: ModelSpec, *, sequence_parallel: bool, microbatch: int, dtype: str, runtime: str = "dtensor",
    accumulated: int = 1,
) -> dict[str, TPPart]:
    """The collectives issued per micro-batch by a layer, the embedding and the head
    (``{"layer", "embedding", "head"}``): as DTensor runs paratrain's plan (``runtime="dtensor"``,
    derived in this module's docstring) or as Megatron-LM's fused layers do (``"megatron"``).
    ``accumulated``: micro-batches whose partial norm gradients are reduced together (see there)."""
    e = dtype_bytes(dtype)
    tokens = microbatch * model.seq
    act = tokens * model.hidden * e
    loss = TPCollective("all_reduce", 4 * tokens, LOSS_VALUES_PER_TOKEN)
    if runtime == "megatron":
        return _megatron_parts(act, loss, sequence_parallel)
    column = 5 if model.activation.gated else 4  # q, k, v, fc1 (+ gate)
    row = 2  # attention output, fc2
    halves = 2  # attention and MLP: one shared input each
    if sequence_parallel:
        norms = 2 * _norm_param_tensors(model)
        layer = TPPart(
            forward=(TPCollective("all_gather", act, halves), TPCollective("reduce_scatter", act, row)),
            backward=(TPCollective("reduce_scatter", act, halves), TPCollective("all_gather", act, row),
                      TPCollective("all_reduce", model.hidden * e, norms / accumulated)),
            modules=column + row + 2 + halves,  # + the two norms and the two gathered inputs
        )
        embedding = TPPart(forward=(TPCollective("all_reduce", act, 1),),
                           backward=(TPCollective("all_gather", act, 1),), modules=2)
        head = TPPart(forward=(TPCollective("all_gather", act, 1), loss),
                      backward=(TPCollective("all_reduce", act, 1),), modules=3)
    else:
        layer = TPPart(forward=(TPCollective("all_reduce", act, row),),
                       backward=(TPCollective("all_reduce", act, halves),), modules=column + row + halves)
        embedding = TPPart(forward=(TPCollective("all_reduce", act, 1),), backward=(), modules=1)
        head = TPPart(forward=(loss,), backward=(TPCollective("all_reduce", act, 1),), modules=2)
    return {"layer": layer, "embedding": embedding, "head": head}


def measured_time(cluster: ClusterSpec, kind: str, group: int, nbytes: int) -> float | None:
    """The time of a ``kind`` collective of ``nbytes`` over ``group`` ranks from the cluster's
    ``measured_collectives``: Hockney's ``alpha + n/beta`` fitted by least squares to the
    measured sizes of that kind and group (a line through three noisy points of a shared machine
    rather than a path through each); without a positive slope, their mean; without a positive
    intercept, the line through the origin. None when not measured."""
    return fit_line(cluster.measured_collectives, kind, group, nbytes)


def collective_cpu(cluster: ClusterSpec, kind: str, group: int, nbytes: int) -> float:
    """CPU seconds one ``kind`` collective of ``nbytes`` over ``group`` processes costs each of
    them, the line of :func:`measured_time` through ``collective_cpu_s`` (0 when not measured)."""
    return fit_line(cluster.collective_cpu_s, kind, group, nbytes) or 0.0


def fit_line(rows: tuple[tuple[str, int, int, float], ...], kind: str, group: int, nbytes: int) -> float | None:
    """The value at ``nbytes`` of the least-squares line in bytes through the ``(kind, group,
    bytes, seconds)`` rows of that kind and group (:func:`measured_time`); None without such rows."""
    pts = [(float(b), s) for k, g, b, s in rows if k == kind and g == group]
    if not pts:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx > 0 else 0.0
    if slope <= 0:
        return my
    alpha = my - slope * mx
    if alpha < 0:
        return nbytes * sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)
    return alpha + slope * nbytes


def group_rate(cluster: ClusterSpec, group: int) -> float:
    """The speed of ``group`` processes computing together, alone on a node's cores, as a
    fraction of one process alone on a core (1 when every device has its own processor)."""
    if cluster.cores_per_node == 0:
        return 1.0
    return min(1.0, cluster.cores_per_node / (group * cluster.threads_per_process))


def _collective_s(cluster: ClusterSpec, ranks: tuple[int, ...], c: TPCollective) -> tuple[float, float]:
    """``(time at full speed, host work within it)`` of ``c``'s collectives."""
    g = len(ranks)
    t = measured_time(cluster, c.kind, g, c.nbytes)
    if t is None:
        t = collective_time(c.kind, c.nbytes, ranks, cluster).time_s
    # the work cannot exceed what the measured time holds (the two are measured apart)
    work = min(collective_cpu(cluster, c.kind, g, c.nbytes), t * group_rate(cluster, g))
    # measured as work / rate + wait: at full speed work + wait
    return c.count * (t - work / group_rate(cluster, g) + work), c.count * work


def collective_s(cluster: ClusterSpec, ranks: tuple[int, ...], kind: str, nbytes: int) -> float:
    """Time of one ``kind`` collective of ``nbytes`` per rank over ``ranks`` at full speed, as
    :func:`tp_part_times` times each (measured where the cluster was calibrated, else alpha-beta)."""
    return _collective_s(cluster, ranks, TPCollective(kind, nbytes, 1))[0]


def tp_part_times(
    part: TPPart, cluster: ClusterSpec, ranks: tuple[int, ...]
) -> tuple[float, float, float, float]:
    """``(forward collectives, backward collectives, forward dispatch, backward dispatch)`` of one
    piece on the tensor-parallel group ``ranks``, in seconds (all 0 for a group of one). The
    collectives' times include their own CPU (:func:`tp_part_cpu`)."""
    if len(ranks) == 1:
        return 0.0, 0.0, 0.0, 0.0
    dev = cluster.device
    return (sum(_collective_s(cluster, ranks, c)[0] for c in part.forward),
            sum(_collective_s(cluster, ranks, c)[0] for c in part.backward),
            part.modules * dev.tp_dispatch_forward_s, part.modules * dev.tp_dispatch_backward_s)


def tp_part_cpu(part: TPPart, cluster: ClusterSpec, ranks: tuple[int, ...]) -> tuple[float, float]:
    """``(forward, backward)`` CPU seconds of one piece's collectives on ``ranks`` (host work, not
    waiting; 0 for a group of one or where the cluster measured none)."""
    if len(ranks) == 1:
        return 0.0, 0.0
    return (sum(_collective_s(cluster, ranks, c)[1] for c in part.forward),
            sum(_collective_s(cluster, ranks, c)[1] for c in part.backward))
