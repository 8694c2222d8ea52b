"""Cost of each model chunk of a pipeline for one micro-batch on one tensor-parallel rank.

This is what the simulator and the planner consume. All layers of a model are identical, so the
per-layer cost is computed once per (model, device, placement) and cached; :func:`chunk_costs`
then only multiplies and adds, O(chunks) per call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from paratrain.cost.async_tp import layer_exposed_s
from paratrain.cost.compute import (
    _embedding_ops,
    _head_ops,
    _layer_ops,
    dtype_bytes,
    host_bound_time,
    kv_dim_per_rank,
    op_kernels,
    op_time_split,
    resolve_attention,
)
from paratrain.cost.context_parallel import kv_block_bytes, local_model, ring_exposed_s, ring_neighbours
from paratrain.cost.dp_reduction import default_overlap_slowdown
from paratrain.cost.elementwise import uses_dropout
from paratrain.cost.fp8 import FP8_GEMM_DTYPES, cached_weight_bytes
from paratrain.cost.memory import activation_bytes_per_layer, grad_dtype_bytes, norm_terms, optimizer_bytes
from paratrain.cost.op import Op
from paratrain.cost.sharding import (
    ShardedUnit,
    fsdp_phases_s,
    gathered_bytes,
    gathers_per_microbatch,
    reshards_after_forward,
    static_shares,
)
from paratrain.cost.tensor_parallel import collective_s, tp_part_cpu, tp_part_times, tp_parts
from paratrain.cost.types import ChunkCost
from paratrain.errors import ConfigError
from paratrain.parallel.config import ParallelConfig, Recompute, ScheduleName
from paratrain.spec.cluster import ClusterSpec
from paratrain.spec.device import DeviceSpec
from paratrain.spec.model import Arch, ModelSpec

__all__ = ["chunk_costs", "PartCost", "layer_cost", "layer_params_per_rank", "partial_grad_accumulation", "tp_ranks"]


@dataclass(frozen=True)
class PartCost:
    """Compute cost of one piece (a layer, the embedding or the head) for one micro-batch."""

    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    selective_recompute_s: float  # forward time of the attention core (what selective recomputes)
    matmul_flops: float  # forward + backward
    activation_bytes: int
    # Device time of the attention core (fused kernel or the s×s kernels), forward and backward: what
    # a context-parallel ring overlaps its K/V transfers with.
    attention_forward_s: float = 0.0
    attention_backward_s: float = 0.0


def _sum_ops(ops: tuple[Op, ...], device: DeviceSpec, dtype: str, activation: int, cp: int = 1) -> PartCost:
    """Device time of the part's kernels, bounded below by the host's time to issue them
    (:func:`host_bound_time`): the forward, the backward and the selectively recomputed attention
    core are each one stream of kernels. A host-bound backward keeps its input/weight-gradient split.

    ``cp`` > 1: ``ops`` are one context-parallel rank's (``s/cp`` tokens) and its attention core runs
    once per ring step, ``cp`` times (:mod:`paratrain.cost.context_parallel`)."""
    fwd = bwd_in = bwd_w = sel = flops = att_f = att_b = 0.0
    n_fwd = n_bwd = n_sel = 0
    for op in ops:
        f, bi, bw = op_time_split(op, device, dtype)
        kf, kbi, kbw = op_kernels(op)
        if op.kind == "attention" or op.recompute_selective:
            f, bi, bw, kf, kbi, kbw = f * cp, bi * cp, bw * cp, kf * cp, kbi * cp, kbw * cp
            att_f += f
            att_b += bi + bw
            if op.is_matmul:
                flops += (cp - 1) * (op.fwd_flops + op.bwd_flops)
        fwd += f
        bwd_in += bi
        bwd_w += bw
        n_fwd += kf
        n_bwd += kbi + kbw
        if op.recompute_selective:
            sel += f
            n_sel += kf
        if op.is_matmul:
            flops += op.fwd_flops + op.bwd_flops
    bwd = bwd_in + bwd_w
    bwd_host = host_bound_time(bwd, n_bwd, device)
    if bwd_host > bwd > 0:
        bwd_in, bwd_w = bwd_in * bwd_host / bwd, bwd_w * bwd_host / bwd
    fwd = host_bound_time(fwd, n_fwd, device)
    sel = host_bound_time(sel, n_sel, device) if n_sel else 0.0
    return PartCost(fwd, bwd_in, bwd_w, sel, flops, activation, att_f, att_b)


@lru_cache(maxsize=4096)
def layer_cost(
    model: ModelSpec, device: DeviceSpec, dtype: str, tp: int, sequence_parallel: bool, microbatch: int,
    recompute: Recompute, fused: bool = False, attention: str = "math", cp: int = 1, gemm_dtype: str | None = None,
    fp8_weight_reuse: int = 1,
) -> PartCost:
    """One transformer layer on one tensor-parallel rank (compute only, no collectives).

    ``cp`` > 1: on one context-parallel rank, ``model`` being that rank's
    (:func:`paratrain.cost.context_parallel.local_model`, ``s/cp`` tokens); the ring's transfers
    are not included. ``fp8_weight_reuse``: forward passes one FP8 cast of the weights serves
    (:func:`paratrain.cost.fp8.fp8_cast_bytes`)."""
    ops = _layer_ops(model, tp=tp, sequence_parallel=sequence_parallel, microbatch=microbatch, fused=fused, dtype=dtype,
                     attention=attention, gemm_dtype=gemm_dtype, fp8_weight_reuse=fp8_weight_reuse)
    act = activation_bytes_per_layer(
        model, microbatch=microbatch, tp=tp, sequence_parallel=sequence_parallel, recompute=recompute, dtype=dtype,
        attention=attention, fused=fused, gemm_dtype=gemm_dtype,
    )
    return _sum_ops(ops, device, dtype, act, cp)


@lru_cache(maxsize=1024)
def _end_cost(
    which: str, model: ModelSpec, device: DeviceSpec, dtype: str, tp: int, sequence_parallel: bool, microbatch: int,
    fused: bool = False,
) -> PartCost:
    """The embedding or the head. Stored activations (Korthikanti et al. 2022, sec. 4.3): the
    embedding keeps its dropout mask; the head keeps the inputs of its norm(s) and GEMMs and the
    fp32 softmax of the vocab-parallel cross entropy."""
    e = dtype_bytes(dtype)
    tokens = microbatch * model.seq
    rows = tokens // tp if sequence_parallel else tokens
    h = model.hidden
    if which == "embedding":
        ops = _embedding_ops(model, tp=tp, sequence_parallel=sequence_parallel, microbatch=microbatch, fused=fused,
                             dtype=dtype)
        act = rows * h if uses_dropout(model) else 0
        return _sum_ops(ops, device, dtype, act)
    ops = _head_ops(model, tp=tp, sequence_parallel=sequence_parallel, microbatch=microbatch, fused=fused, dtype=dtype)
    vocab_r = -(-model.vocab // tp)
    if model.arch is Arch.BERT:
        act = 4 * e * tokens * h + 4 * tokens * vocab_r
    else:  # the final norm's saved tensors (eager RMSNorm's fp32 copy), the LM head's input, the softmax
        final_norm = sum(n for _, n, _ in norm_terms("final norm", model, rows, e, fused=fused))
        act = final_norm + e * rows * h + 4 * tokens * vocab_r
    return _sum_ops(ops, device, dtype, act)


@lru_cache(maxsize=1024)
def layer_params_per_rank(model: ModelSpec, tp: int) -> int:
    """Parameters of one layer held by one tensor-parallel rank: column-parallel weights and biases
    (QKV, first MLP GEMM) and row-parallel weights (projection, second MLP GEMM) are split over
    ``tp``; row-parallel biases and the norms are replicated. Equals ``params_per_layer`` at tp=1."""
    h, t = model.hidden, tp
    q_r, kv_r, f_r = model.q_dim // t, kv_dim_per_rank(model, t), model.ffn_size // t
    gates = 2 if model.activation.gated else 1
    n = h * (q_r + 2 * kv_r) + q_r * h  # QKV, projection
    n += gates * h * f_r + f_r * h  # MLP
    if model.bias:
        n += (q_r + 2 * kv_r) + h + gates * f_r + h
    return n + 2 * model.norm_params()


def _embedding_params_per_rank(model: ModelSpec, tp: int) -> int:
    """Vocab-parallel word embedding; positions, token types and BERT's norm are replicated."""
    vocab_r = -(-model.vocab // tp)
    return model.embedding_params() - model.vocab * model.hidden + vocab_r * model.hidden


def _head_params_per_rank(model: ModelSpec, tp: int, *, shares_embedding_chunk: bool) -> int:
    """Final norm / MLM head, and the output matrix: its own when untied; when tied and the head
    sits on another chunk than the embedding, a copy of the word embedding (Megatron-LM keeps one
    on the last stage and all-reduces the two copies' gradients)."""
    vocab_r = -(-model.vocab // tp)
    n = model.head_params()
    if not model.tied_embeddings:
        n += vocab_r * model.hidden - model.vocab * model.hidden
    elif not shares_embedding_chunk:
        n += vocab_r * model.hidden
    return n


def tp_ranks(config: ParallelConfig) -> tuple[int, ...]:
    """Global ranks of the first tensor-parallel group (``config.group_ranks("tp")[0]``): the
    other coordinates are 0, so the ranks are ``tp`` multiples of the tp axis' mesh stride."""
    stride = 1
    for axis in reversed(config.mesh_order):
        if axis == "tp":
            break
        stride *= config.axis_size(axis)
    return tuple(range(0, config.tp * stride, stride))


def cp_ranks(config: ParallelConfig) -> tuple[int, ...]:
    """Global ranks of the first context-parallel group (``config.group_ranks("cp")[0]``)."""
    return tuple(config.rank_of(cp=i) for i in range(config.cp))


@lru_cache(maxsize=4096)
def _ring_transfer_s(nbytes: int, ranks: tuple[int, ...], cluster: ClusterSpec) -> float:
    """One ring step: every rank sends ``nbytes`` to its successor at once; the slowest pair sets
    the pace (a pair across nodes whenever the ring leaves a node)."""
    from paratrain.cost.collectives import collective_time

    pairs = ring_neighbours(ranks)
    if not pairs or nbytes <= 0:
        return 0.0
    by_link = {(cluster.node_of(a) == cluster.node_of(b)): (a, b) for a, b in pairs}
    return max(collective_time("p2p", nbytes, pair, cluster).time_s for pair in by_link.values())


@lru_cache(maxsize=4096)
def _tp_comm(
    model: ModelSpec, cluster: ClusterSpec, ranks: tuple[int, ...], sequence_parallel: bool, microbatch: int,
    dtype: str, accumulated: int = 1,
) -> tuple[float, float, float, float, float, float]:
    """Tensor-parallel time per micro-batch: (layer forward, layer backward, embedding forward,
    embedding backward, head forward, head backward).

    The collectives the cluster's tensor-parallel runtime issues (``cluster.tensor_parallel``:
    Megatron-LM's fused layers, or DTensor as paratrain's runtime runs them), timed as measured on
    the cluster where it was calibrated, plus DTensor's host dispatch per parallelized module
    (:mod:`paratrain.cost.tensor_parallel`).
    """
    parts = tp_parts(model, sequence_parallel=sequence_parallel, microbatch=microbatch, dtype=dtype,
                     runtime=cluster.tensor_parallel, accumulated=accumulated)
    out: list[float] = []
    for name in ("layer", "embedding", "head"):
        cf, cb, df, db = tp_part_times(parts[name], cluster, ranks)
        out += [cf + df, cb + db]
    lf, lb, ef, eb, hf, hb = out
    return lf, lb, ef, eb, hf, hb


@lru_cache(maxsize=4096)
def _tp_dispatch(
    model: ModelSpec, cluster: ClusterSpec, ranks: tuple[int, ...], sequence_parallel: bool, microbatch: int,
    dtype: str, accumulated: int = 1,
) -> tuple[float, float, float, float, float, float]:
    """The host work inside :func:`_tp_comm`'s times, in the same order: DTensor's dispatch and
    the collectives' own CPU (the rest of those times is waiting, which takes no core)."""
    parts = tp_parts(model, sequence_parallel=sequence_parallel, microbatch=microbatch, dtype=dtype,
                     runtime=cluster.tensor_parallel, accumulated=accumulated)
    out: list[float] = []
    for name in ("layer", "embedding", "head"):
        _, _, df, db = tp_part_times(parts[name], cluster, ranks)
        wf, wb = tp_part_cpu(parts[name], cluster, ranks)
        out += [df + wf, db + wb]
    lf, lb, ef, eb, hf, hb = out
    return lf, lb, ef, eb, hf, hb


@dataclass(frozen=True)
class _Bundle:
    """Everything :func:`chunk_costs` needs that does not depend on the chunk's layer count."""

    layer: PartCost
    embedding: PartCost
    head: PartCost
    comm: tuple[float, float, float, float, float, float]
    recompute_layer_s: float
    recompute_comm_s: float
    layer_params: int
    embedding_params: int
    head_params_shared: int  # head parameters when the head shares its chunk with the embedding
    head_params_apart: int
    p2p_bytes: int
    transient_bytes: int
    dtype_bytes: int
    optimizer_bytes_per_param: int
    cp_comm: tuple[float, float] = (0.0, 0.0)  # ring time a layer's forward / backward adds (exposed)
    cp_buffer_bytes: int = 0
    p2p_gather_s: float = 0.0  # re-assembling a received scattered activation (_p2p_split)
    fp8_cache_layer_bytes: int = 0  # a layer's cached FP8 weights if the run caches them (cost.fp8)


def _p2p_split(cluster: ClusterSpec, tp: int, sp: bool) -> bool:
    """Whether each tensor-parallel rank sends only its ``1/tp`` slice of the activation between
    stages. With sequence parallelism the activation is already split along the sequence. Without
    it, Megatron-LM's scatter/gather optimization (Narayanan et al. SC'21, sec. 4.1;
    ``scatter_gather_tensors_in_pipeline``, on by default) splits the replicated activation across
    the tensor-parallel ranks before the send and all-gathers it over the node's links after the
    receive, and DeepSpeed's pipeline engine does the same (``PipelineEngine.is_pipe_partitioned``
    is set whenever the model is tensor-parallel: ``PartitionedTensor`` slices, gathered on
    arrival), so Megatron-DeepSpeed's runs split too. paratrain's own runtime (``tensor_parallel
    == "dtensor"``) sends every rank's full copy (``runtime/pipeline.py``)."""
    return tp > 1 and (sp or cluster.tensor_parallel == "megatron")


def _ring_comm(
    model: ModelSpec, cluster: ClusterSpec, layer: PartCost, dtype: str, tp: int, mb: int, cp: int,
    cp_group: tuple[int, ...],
) -> tuple[tuple[float, float], int]:
    """Exposed ring time of one layer's forward and backward, and its receive buffers; ``model`` is
    one context-parallel rank's (``s/cp`` tokens), so its K and V are one ring block."""
    if cp == 1:
        return (0.0, 0.0), 0
    kv = kv_block_bytes(model, cp=1, tp=tp, microbatch=mb, dtype=dtype)  # K, V forward; + dK, dV backward
    fwd = ring_exposed_s(layer.attention_forward_s, _ring_transfer_s(kv, cp_group, cluster), cp)
    bwd = ring_exposed_s(layer.attention_backward_s, _ring_transfer_s(2 * kv, cp_group, cluster), cp)
    return (fwd, bwd), 2 * 2 * kv


def _overlapped_tp_comm(
    model: ModelSpec, cluster: ClusterSpec, ranks: tuple[int, ...], mb: int, dtype: str, fused: bool,
    attention: str, gemm_dtype: str | None, comm: tuple[float, ...], overlap: str, fp8_weight_reuse: int = 1,
) -> tuple[float, float, float, float, float, float]:
    """``comm`` with the layer's forward (and with ``overlap`` "userbuffers" its backward) replaced
    by what the fused collectives leave exposed (:mod:`paratrain.cost.async_tp`); the embedding's
    and the head's collectives stay as they are."""
    if cluster.tensor_parallel != "megatron":
        raise ConfigError("tp_overlap", f"the cluster's tensor-parallel runtime ({cluster.tensor_parallel}, as "
                          "paratrain train runs it on this host) issues its collectives unfused",
                          "use --tp-overlap none here, or plan for a GPU cluster preset (dgx-a100, dgx-h100)")
    act = mb * model.seq * model.hidden * dtype_bytes(dtype)
    ops = _layer_ops(model, tp=len(ranks), sequence_parallel=True, microbatch=mb, fused=fused, dtype=dtype,
                     attention=attention, gemm_dtype=gemm_dtype, fp8_weight_reuse=fp8_weight_reuse)
    fwd, bwd = layer_exposed_s(ops, cluster.device, dtype, len(ranks), collective_s(cluster, ranks, "all_gather", act),
                               collective_s(cluster, ranks, "reduce_scatter", act))
    _, plain_bwd, ef, eb, hf, hb = comm
    return fwd, bwd if overlap == "userbuffers" else plain_bwd, ef, eb, hf, hb


@lru_cache(maxsize=16384)
def _bundle(
    model: ModelSpec, cluster: ClusterSpec, dtype: str, tp: int, sp: bool, mb: int, rc: Recompute, fused: bool,
    ranks: tuple[int, ...], attention: str = "math", cp: int = 1, cp_group: tuple[int, ...] = (),
    gemm_dtype: str | None = None, tp_overlap: str = "none", fp8_weight_reuse: int = 1, accumulated: int = 1,
) -> _Bundle:
    device = cluster.device
    layer = layer_cost(model, device, dtype, tp, sp, mb, rc, fused, attention, cp, gemm_dtype, fp8_weight_reuse)
    comm = _tp_comm(model, cluster, ranks, sp, mb, dtype, accumulated)
    if tp_overlap != "none" and tp > 1:
        comm = _overlapped_tp_comm(model, cluster, ranks, mb, dtype, fused, attention, gemm_dtype, comm, tp_overlap,
                                   fp8_weight_reuse)
    cp_comm, cp_buffer = _ring_comm(model, cluster, layer, dtype, tp, mb, cp, cp_group)
    if rc is Recompute.FULL:
        rec, rec_comm = layer.forward_s + comm[0] + cp_comm[0], comm[0]  # the ring runs again too
    elif rc is Recompute.SELECTIVE:
        rec, rec_comm = layer.selective_recompute_s, 0.0
    else:
        rec = rec_comm = 0.0
    e = dtype_bytes(dtype)
    act = mb * model.seq * model.hidden * e
    split = _p2p_split(cluster, tp, sp)
    # the receiver all-gathers the slices of a replicated activation (or its gradient) back
    gather = collective_s(cluster, ranks, "all_gather", act) if split and not sp else 0.0
    return _Bundle(
        layer=layer, embedding=_end_cost("embedding", model, device, dtype, tp, sp, mb, fused),
        head=_end_cost("head", model, device, dtype, tp, sp, mb, fused), comm=comm, recompute_layer_s=rec,
        recompute_comm_s=rec_comm, layer_params=layer_params_per_rank(model, tp),
        embedding_params=_embedding_params_per_rank(model, tp),
        head_params_shared=_head_params_per_rank(model, tp, shares_embedding_chunk=True),
        head_params_apart=_head_params_per_rank(model, tp, shares_embedding_chunk=False),
        p2p_bytes=act // (tp if split else 1), p2p_gather_s=gather, dtype_bytes=e,
        transient_bytes=activation_bytes_per_layer(
            model, microbatch=mb, tp=tp, sequence_parallel=sp, recompute=Recompute.NONE, dtype=dtype,
            attention=attention, fused=fused, gemm_dtype=gemm_dtype,
        ) - layer.activation_bytes + cp_buffer,
        optimizer_bytes_per_param=optimizer_bytes(1, dtype), cp_comm=cp_comm, cp_buffer_bytes=cp_buffer,
        fp8_cache_layer_bytes=cached_weight_bytes(_layer_ops(
            model, tp=tp, sequence_parallel=sp, microbatch=1, fused=fused, dtype=dtype, attention=attention,
            gemm_dtype=gemm_dtype)) if gemm_dtype in FP8_GEMM_DTYPES else 0,
    )


@lru_cache(maxsize=65536)
def _dp_collective_s(kind: str, nbytes: int, cluster: ClusterSpec,
                     group: tuple[tuple[str, ...], int, int, int, int]) -> float:
    """Time of one collective over the first data-parallel (× context-parallel) group of the layout
    ``group`` = (mesh order, dp, tp, pp, cp); cached: the planner asks for the same few per layout."""
    from paratrain.cost.collectives import collective_time

    order, dp, tp, pp, cp = group
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp, mesh_order=order, global_batch=dp, attention="flash")
    ranks = tuple(cfg.rank_of(dp=d, cp=k) for d in range(dp) for k in range(cp))
    return collective_time(kind, nbytes, ranks, cluster).time_s


def _fsdp_units(
    bd: _Bundle, n: int, first: bool, final: bool, comm_s: Callable[[str, int], float]
) -> list[ShardedUnit]:
    """The FSDP units of a chunk in forward order: the embedding, one per layer, the head (the
    runtime's ``fully_shard`` per block; the embedding and head as units of their own, as in
    torchtitan). ``comm_s(kind, bytes)`` times a collective over the data-parallel group."""
    c, e = bd.comm, bd.dtype_bytes

    def unit(part: PartCost, fwd_comm: float, bwd_comm: float, recompute_s: float, params: int) -> ShardedUnit:
        return ShardedUnit(part.forward_s + fwd_comm,
                           recompute_s + part.backward_input_s + bwd_comm + part.backward_weight_s,
                           comm_s("all_gather", params * e), comm_s("reduce_scatter", params * e))

    units = [unit(bd.embedding, c[2], c[3], 0.0, bd.embedding_params)] if first else []
    units += [unit(bd.layer, c[0], c[1], bd.recompute_layer_s, bd.layer_params)] * n
    if final:
        units.append(unit(bd.head, c[4], c[5], 0.0, bd.head_params_shared if first else bd.head_params_apart))
    return units


def fp8_weight_reuse(config: ParallelConfig) -> int:
    """Forward passes of a layer that one FP8 cast of its weights serves: 1, or with
    ``config.fp8_weight_cache`` every forward of the step — one per micro-batch, two under full
    recomputation (the recomputed forward reuses the cache too) — so that a step casts each weight
    once (:func:`paratrain.cost.fp8.fp8_cast_bytes`). Selective recomputation recomputes no linear
    layer."""
    if not config.fp8_weight_cache:
        return 1
    return config.num_microbatches * (2 if config.recompute is Recompute.FULL else 1)


def partial_grad_accumulation(config: ParallelConfig) -> int:
    """Micro-batches whose partial tensor-parallel gradients (the sequence-parallel norms') the
    runtime sums before it all-reduces them once (``runtime.tensor_parallel.accumulating_partial_grads``):
    every micro-batch of a step, or one under the asynchronous schedules, which step after each
    (PipeDream) or keep their weight versions' gradients apart (2BW). 1 without sequence
    parallelism, where nothing is left partial."""
    if not (config.sequence_parallel and config.tp > 1) or config.schedule.is_async:
        return 1
    return config.num_microbatches


def chunk_costs(
    model: ModelSpec, cluster: ClusterSpec, config: ParallelConfig, *, fused: bool = False
) -> list[ChunkCost]:
    """Cost of every model chunk in pipeline order, for one micro-batch on one tensor-parallel rank.

    Chunk ``i`` holds ``config.layers_per_chunk(model.layers)[i]`` layers; chunk 0 also holds the
    embedding, the last chunk the head and the loss. The TP collectives are timed on the first TP
    group's ranks as placed on ``cluster``. ``grad_reduce_bytes`` is the chunk's gradient bytes (the
    data-parallel all-reduce is timed by the simulator). Attention is ``config.attention``, or
    what the device runs by default (:func:`paratrain.cost.compute.default_attention`).
    """
    config.validate_for(model)
    ranks = tp_ranks(config)
    if ranks[-1] >= cluster.num_devices:
        raise ConfigError(
            "tp", f"the tensor-parallel group {list(ranks)} does not fit the cluster's {cluster.num_devices} devices",
            "use a larger cluster (more GPUs or nodes) or a smaller tp",
        )
    # Ring attention runs on fused attention kernels (Transformer Engine's flash / cuDNN backends).
    attention = "flash" if config.cp > 1 else resolve_attention(config.attention, cluster.device)
    cp_group = cp_ranks(config)
    if cp_group[-1] >= cluster.num_devices:
        raise ConfigError(
            "cp", f"the context-parallel group {list(cp_group)} does not fit the cluster's {cluster.num_devices} "
            "devices", "use a larger cluster (more GPUs or nodes) or a smaller cp",
        )
    # Each context-parallel rank holds s/cp tokens of every sequence (cost.context_parallel).
    accumulated = partial_grad_accumulation(config)
    bd = _bundle(local_model(model, config.cp), cluster, config.dtype, config.tp, config.sequence_parallel,
                 config.microbatch, config.recompute, fused, ranks, attention, config.cp, cp_group,
                 gemm_dtype=config.gemm_dtype, tp_overlap=config.tp_overlap,
                 fp8_weight_reuse=fp8_weight_reuse(config), accumulated=accumulated)
    layer, comm, e = bd.layer, bd.comm, bd.dtype_bytes
    cp_f, cp_b = bd.cp_comm
    cp_rec = cp_f if config.recompute is Recompute.FULL else 0.0
    disp = _tp_dispatch(local_model(model, config.cp), cluster, ranks, config.sequence_parallel, config.microbatch,
                        config.dtype, accumulated)
    waits = [c - d for c, d in zip(comm, disp, strict=True)]  # the collectives' waiting, without host work
    wait_rec = waits[0] + cp_f if config.recompute is Recompute.FULL else 0.0  # the recomputed forward's
    # Parameters are replicated over cp: sharding and gradient reduction span the dp-cp group (Megatron-LM's
    # distributed optimizer, torchtitan's dp_shard_cp mesh).
    dp, level = config.dp * config.cp, config.sharding
    counts = config.layers_per_chunk(model.layers)
    last = len(counts) - 1
    # zero2/zero3 (cost.sharding): each micro-batch gathers every unit's parameters and
    # reduce-scatters its gradients over dp, overlapped with the neighbouring units' compute.
    fsdp = gathers_per_microbatch(level, dp)
    # FSDP2 under a split backward (runtime/pipeline_engine.py, LocalChunk.hold_gradients): the weight
    # pass comes after the input pass, so gradients accumulate unsharded over the step and are
    # reduce-scattered once, at R (the per-micro-batch collectives below are still charged)
    held_grads = fsdp and config.pp > 1 and config.schedule is ScheduleName.ZB_H1
    group_key = (config.mesh_order, config.dp, config.tp, config.pp, config.cp)

    def comm_s(kind: str, nbytes: int) -> float:
        return _dp_collective_s(kind, nbytes, cluster, group_key)

    def make(n: int, first: bool, final: bool) -> ChunkCost:
        fwd = n * (layer.forward_s + comm[0] + cp_f)
        bwd_in = n * (layer.backward_input_s + comm[1] + cp_b)
        bwd_w = n * layer.backward_weight_s
        tp_comm = n * (comm[0] + comm[1] + bd.recompute_comm_s)
        act = n * layer.activation_bytes
        flops = n * layer.matmul_flops
        params = n * bd.layer_params
        if first:
            emb = bd.embedding
            fwd += emb.forward_s + comm[2]
            bwd_in += emb.backward_input_s + comm[3]
            bwd_w += emb.backward_weight_s
            tp_comm += comm[2] + comm[3]
            act += emb.activation_bytes
            flops += emb.matmul_flops
            params += bd.embedding_params
        if final:
            head = bd.head
            fwd += head.forward_s + comm[4]
            bwd_in += head.backward_input_s + comm[5]
            bwd_w += head.backward_weight_s
            tp_comm += comm[4] + comm[5]
            act += head.activation_bytes
            flops += head.matmul_flops
            params += bd.head_params_shared if first else bd.head_params_apart
        grads = params * e
        # A bf16 model's gradients are kept in fp32 (cost.memory.grad_dtype_bytes): Megatron's
        # buffer holds them all (none, zero1), ZeRO-2/3 their shard (DeepSpeed's bf16 optimizer
        # keeps fp32 gradient partitions).
        w, g, o = static_shares(level, grads, params * grad_dtype_bytes(config.dtype),
                                params * bd.optimizer_bytes_per_param, dp)
        if held_grads:  # the runtime's FSDP2 under ZB-H1 keeps the chunk's unsharded gradients until R
            g = params * grad_dtype_bytes(config.dtype)
        gathered = 0
        fsdp_f = fsdp_b = 0.0
        if fsdp:
            units = _fsdp_units(bd, n, first, final, comm_s)
            f_s, b_s = fsdp_phases_s(units, reshard_after_forward=reshards_after_forward(level),
                                     slowdown=default_overlap_slowdown(cluster.device))  # beside the collectives
            fsdp_f = f_s - sum(u.forward_s for u in units)  # exposed all-gathers
            fsdp_b = b_s - sum(u.backward_s for u in units)  # exposed re-gathers and reduce-scatters
            fwd += fsdp_f
            bwd_in += fsdp_b
            unit = e * max([bd.layer_params] * (n > 0) + [bd.embedding_params] * first
                           + [bd.head_params_shared if first else bd.head_params_apart] * final)
            # zero2's whole-rank parameters are added below, where the chunks of a rank are known
            gathered = gathered_bytes(level, dp, unit_weight=unit, unit_grad=unit, rank_weight=0)
        return ChunkCost(
            forward_s=fwd, backward_input_s=bwd_in, backward_weight_s=bwd_w, recompute_s=n * bd.recompute_layer_s,
            tp_comm_s=tp_comm, activation_bytes=act, weight_bytes=w, grad_bytes=g,
            optimizer_bytes=o, grad_reduce_bytes=grads,
            p2p_bytes=bd.p2p_bytes, p2p_gather_s=bd.p2p_gather_s, model_flops=flops,
            transient_bytes=bd.transient_bytes + gathered,
            fp8_cache_bytes=n * bd.fp8_cache_layer_bytes if config.fp8_weight_cache else 0,
            cp_comm_s=n * (cp_f + cp_b + cp_rec), fsdp_comm_s=fsdp_f + fsdp_b,
            forward_wait_s=n * (waits[0] + cp_f) + first * waits[2] + final * waits[4] + fsdp_f,
            backward_wait_s=n * (waits[1] + cp_b + wait_rec) + first * waits[3] + final * waits[5] + fsdp_b,
        )

    # Middle chunks differ only in their layer count (at most two values for an even split).
    middle = {n: make(n, False, False) for n in set(counts[1:last])}
    out = [middle[n] for n in counts[1:last]]
    if last == 0:
        out = [make(counts[0], True, True)]
    else:
        out = [make(counts[0], True, False), *out, make(counts[last], False, True)]
    if fsdp and level == "zero2":
        # Every chunk on a pipeline rank (chunk k on rank k mod pp) keeps its gathered parameters
        # from its forward to its backward: the rank's whole share of the model, once.
        full = [e * (n * bd.layer_params + (bd.embedding_params if k == 0 else 0)
                     + ((bd.head_params_shared if last == 0 else bd.head_params_apart) if k == last else 0))
                for k, n in enumerate(counts)]
        rank_w = [sum(full[r::config.pp]) for r in range(config.pp)]
        held: dict[tuple[int, int], ChunkCost] = {}  # few distinct (chunk, rank share) pairs: build each once
        for k, c in enumerate(out):
            key = (id(c), rank_w[k % config.pp])
            if key not in held:
                held[key] = dataclasses.replace(c, transient_bytes=c.transient_bytes + key[1])
            out[k] = held[key]
    return out
